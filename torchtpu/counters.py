"""Counters that make the executors' behaviour visible (`torchtpu.metrics()`)."""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

_lock = threading.Lock()
_counters: collections.Counter[str] = collections.Counter()
_timers: collections.Counter[str] = collections.Counter()
_by_op: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
# Counters kept elsewhere (the C++ fast path's): (read them, reset them).
_sources: list[tuple[Callable[[], dict[str, int]], Callable[[], None]]] = []


def count(name: str, n: int = 1) -> None:
    _counters[name] += n


def count_op(table: str, op: str, n: int = 1) -> None:
    with _lock:
        _by_op[table][op] += n


def add_time(name: str, seconds: float) -> None:
    _timers[name] += seconds


def add_source(read: Callable[[], dict[str, int]], reset: Callable[[], None]) -> None:
    """Counters kept outside Python: `snapshot` reports the non-zero ones, `reset` resets them."""
    _sources.append((read, reset))


def snapshot() -> dict[str, Any]:
    """A copy of every counter: plain counts, per-op tables and accumulated seconds."""
    with _lock:
        out: dict[str, Any] = dict(_counters)
        for read, _ in _sources:
            out.update({k: v for k, v in read().items() if v})
        out.update({f"{k}_seconds": v for k, v in _timers.items()})
        for table, counter in _by_op.items():
            out[table] = dict(counter)
    return out


def reset() -> None:
    with _lock:
        for _, reset_source in _sources:
            reset_source()
        _counters.clear()
        _timers.clear()
        _by_op.clear()
