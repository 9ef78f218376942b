"""Events of tpu devices (`torch.Event(device="tpu")`, `torch.tpu.Event`): markers of the work
issued to a device up to the moment they were recorded.

A device runs what is issued to it as one queue (`torchtpu.streams`), so an event needs no place
in a queue: recording one runs the deferred executor's pending ops and notes the device's arrays
still being computed at that moment (weakly: an event keeps no result alive). The event has
completed once all of them are (`query`), and `synchronize` waits for them -- as
`torch.tpu.synchronize` waits for every array of the device. A stream waiting for an event
(`Stream.wait_event`) has nothing to wait for: work on tpu values waits for the work that
produces them.

An event made with `enable_timing=True` is also stamped with the time its work finished, so that
`start.elapsed_time(end)` times the device work between two records, as on CUDA. The runtime
gives no device clock, so the stamp is the host's (`time.perf_counter_ns`): the record's time when
nothing was still being computed, else taken by the device's clock thread (`_Clock`) once the last
of the event's arrays is ready -- shortly after the device finished (the thread needs the GIL to take
it: up to Python's switch interval, 5 ms, while another thread runs Python). `elapsed_time` waits
for both stamps.

The C++ device guard (`csrc/device_guard.cpp`) calls these functions for PyTorch's event API.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
import time
import weakref

import torch

__all__ = ["Event"]

_events: dict[int, list[weakref.ref]] = {}
_ids = itertools.count(1)

def computing(device: int, reason: str) -> list:
    """The arrays of `device` still being computed, once the deferred executor's pending ops are
    issued (flushed for `reason`): what an event records and `torch.tpu.synchronize` waits for."""
    import jax

    from torchtpu import runtime
    from torchtpu.exec import deferred

    deferred.flush(reason)
    if not runtime.is_started():
        return []
    target = runtime.jax_device(device)
    return [array for array in jax.live_arrays()
            if not array.is_deleted() and not array.is_ready() and target in array.devices()]


def record(device: int, event: int, timing: bool = False) -> int:
    """Record `event` (0: a new one) on `device`, and with `timing` stamp it once its work is
    done; its id."""
    if event == 0:
        event = next(_ids)
    arrays = computing(device, "event")
    _events[event] = [weakref.ref(array) for array in arrays]
    if timing:
        _stamps[event] = _clock(device).stamp_when_done(arrays)
    else:
        _stamps.pop(event, None)
    return event


def _pending(event: int) -> list:
    """The arrays `event` still waits for (those computed or freed since are dropped)."""
    arrays = [array for array in (ref() for ref in _events.get(event, ())) if array is not None
              and not array.is_deleted() and not array.is_ready()]
    if event in _events:
        _events[event] = [weakref.ref(array) for array in arrays]
    return arrays


def query(event: int) -> bool:
    """Whether everything issued before `event` was recorded has finished."""
    return not _pending(event)


def synchronize(event: int) -> None:
    """Wait until everything issued before `event` was recorded has finished."""
    from torchtpu.exec import checks

    for array in _pending(event):
        array.block_until_ready()
    _events[event] = []
    checks.raise_pending()


def elapsed_time(start: int, end: int) -> float:
    """Milliseconds from when `start`'s work finished to when `end`'s did, once both have."""
    if start not in _stamps or end not in _stamps:
        raise ValueError("elapsed_time needs two events created with enable_timing=True, e.g. "
                         "torch.tpu.Event(enable_timing=True)")
    return (_stamps[end].wait() - _stamps[start].wait()) / 1e6


def destroy(event: int) -> None:
    _events.pop(event, None)
    _stamps.pop(event, None)


class _Stamp:
    """When an event's work finished, by the host's clock (ns); set once."""

    __slots__ = ("_done", "_ns")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._ns = 0

    def set(self, ns: int) -> None:
        self._ns = ns
        self._done.set()

    def wait(self) -> int:
        self._done.wait()
        return self._ns


_stamps: dict[int, _Stamp] = {}  # of the events recorded with timing


class _Clock:
    """Stamps one device's timing events, in record order, on a thread of its own (each device
    is a queue of its own, so one's work never holds up another's stamps): an event whose work
    was still running when recorded once its arrays are ready, one with nothing to wait for at
    its record's time -- but never before an earlier event's stamp, which the thread may take
    only after the later record (a later event's arrays include every array of the device still
    pending from an earlier one, so its work never finishes first)."""

    def __init__(self, device: int) -> None:
        self._waiting: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"torchtpu-event-clock-{device}", daemon=True).start()

    def stamp_when_done(self, arrays: list) -> _Stamp:
        """A stamp of the moment every one of `arrays` is ready."""
        stamp = _Stamp()
        # Weakly, as events hold arrays: one freed meanwhile has nothing left to wait for.
        self._waiting.put((stamp, time.perf_counter_ns(), [weakref.ref(array) for array in arrays]))
        return stamp

    def _run(self) -> None:
        last = 0
        while True:
            stamp, recorded, refs = self._waiting.get()
            try:
                for ref in refs:
                    _until_ready(ref())
            finally:
                last = max(last, time.perf_counter_ns() if refs else recorded)
                stamp.set(last)


def _until_ready(array) -> None:
    """Wait until `array` (None once freed) is computed. A failed computation has finished too:
    its error is for whoever reads the array, not for the clock; and an array given up (donated)
    meanwhile has no computation left to wait for."""
    if array is None or array.is_deleted():
        return
    try:
        array.block_until_ready()
    except RuntimeError:  # the computation failed, or the array was donated since the check
        pass


@functools.cache
def _clock(device: int) -> _Clock:
    return _Clock(device)


os.register_at_fork(after_in_child=_clock.cache_clear)  # a forked child has no clock thread


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
    """`torch.Event` of the current tpu device (as `torch.cuda.Event` is of the current GPU);
    with `enable_timing`, `elapsed_time` between two of them times the device work in between."""
    from torchtpu import device_guard

    return torch.Event(torch.device("tpu", device_guard.current_device()), enable_timing=enable_timing,
                       blocking=blocking, interprocess=interprocess)
