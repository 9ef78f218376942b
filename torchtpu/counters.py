"""Counters that make the executors' behaviour visible (`torchtpu.metrics()`)."""

from __future__ import annotations

import collections
import threading
from typing import Any

_lock = threading.Lock()
_counters: collections.Counter[str] = collections.Counter()
_timers: collections.Counter[str] = collections.Counter()
_by_op: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def count(name: str, n: int = 1) -> None:
    _counters[name] += n


def count_op(table: str, op: str, n: int = 1) -> None:
    with _lock:
        _by_op[table][op] += n


def add_time(name: str, seconds: float) -> None:
    _timers[name] += seconds


def snapshot() -> dict[str, Any]:
    """A copy of every counter: plain counts, per-op tables and accumulated seconds."""
    with _lock:
        out: dict[str, Any] = dict(_counters)
        out.update({f"{k}_seconds": v for k, v in _timers.items()})
        for table, counter in _by_op.items():
            out[table] = dict(counter)
    return out


def reset() -> None:
    with _lock:
        _counters.clear()
        _timers.clear()
        _by_op.clear()
