"""The eager execution mode: `strict` (default), `debug` or `defer`.

- strict: each op runs asynchronously as its own cached XLA program;
- debug: as strict, but every op blocks until done, so errors surface at their line;
- defer (DeferAndFuse): ops are recorded and fused into one XLA program when a value is needed.

Set with `torchtpu.set_eager_mode(mode)`, the `torchtpu.eager_mode(mode)` context manager, or
the `TORCHTPU_EAGER_MODE` environment variable (read at import).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

MODES = ("strict", "debug", "defer")


def _check(mode: str) -> str:
    mode = str(mode).lower()
    if mode not in MODES:
        raise ValueError(f"unknown eager mode {mode!r}; expected one of {MODES}")
    return mode


_mode = _check(os.environ.get("TORCHTPU_EAGER_MODE", "strict") or "strict")
# Called with the new mode after every switch (the C++ fast path serves strict and defer only).
on_change: list[Callable[[str], None]] = []


def current() -> str:
    return _mode


def set_mode(mode: str) -> None:
    """Switch the eager mode. Leaving `defer` first runs everything pending."""
    global _mode
    mode = _check(mode)
    if _mode == "defer" and mode != "defer":
        from torchtpu.exec import deferred

        deferred.flush("mode change")
    _mode = mode
    for listener in on_change:
        listener(mode)


@contextlib.contextmanager
def eager_mode(mode: str) -> Iterator[None]:
    previous = _mode
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)
