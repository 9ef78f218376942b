"""Device-side checks: bad input found inside a compiled program (an index out of range).

A lowering states what must hold (`ctx.check(ok, message)`); the program computes a flag next to
its results. Reading the flag would stall the device after every op, so -- as CUDA reports a
device-side assertion -- a failed check is raised at the next point where the host waits for the
device anyway: a value read to the host (`.item()`, `.cpu()`, `print`), `torch.tpu.synchronize()`,
or at once in `debug` mode. Nothing is dropped or clamped silently meanwhile: the error names the
op and what was wrong, and every later read raises it until it has been reported once.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence


class DeviceCheckError(RuntimeError):
    """A device-side check failed (reported at the first synchronisation after the op)."""


_lock = threading.Lock()
_pending: list[tuple[Any, str]] = []


def add(flags: Sequence[Any], messages: Sequence[str]) -> None:
    """Remember the check flags of one program run."""
    if flags:
        with _lock:
            _pending.extend(zip(flags, messages))


def raise_pending() -> None:
    """Read every pending flag (one transfer) and raise the first check that failed."""
    if not _pending:
        return
    import jax

    with _lock:
        pending = list(_pending)
        _pending.clear()
    values = jax.device_get([flag for flag, _ in pending])
    for ok, (_, message) in zip(values, pending):
        if not bool(ok):
            raise DeviceCheckError(f"tpu device-side check failed: {message}")
