"""Events of tpu devices (`torch.Event(device="tpu")`, `torch.tpu.Event`): markers of the work
issued to a device up to the moment they were recorded.

A device runs what is issued to it as one queue (`torchtpu.streams`), so an event needs no place
in a queue: recording one runs the deferred executor's pending ops and notes the device's arrays
still being computed at that moment (weakly: an event keeps no result alive). The event has
completed once all of them are (`query`), and `synchronize` waits for them -- as
`torch.tpu.synchronize` waits for every array of the device. A stream waiting for an event
(`Stream.wait_event`) has nothing to wait for: work on tpu values waits for the work that
produces them. There is no device clock to read, so `elapsed_time` raises; time a region with
`torch.tpu.synchronize()` and `time.perf_counter()` instead.

The C++ device guard (`csrc/device_guard.cpp`) calls these functions for PyTorch's event API.
"""

from __future__ import annotations

import itertools
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


def record(device: int, event: int) -> int:
    """Record `event` (0: a new one) on `device`; its id."""
    if event == 0:
        event = next(_ids)
    _events[event] = [weakref.ref(array) for array in computing(device, "event")]
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


def destroy(event: int) -> None:
    _events.pop(event, None)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
    """`torch.Event` of the current tpu device (as `torch.cuda.Event` is of the current GPU).
    `enable_timing` is accepted, but `elapsed_time` raises: tpu events carry no device clock."""
    from torchtpu import device_guard

    return torch.Event(torch.device("tpu", device_guard.current_device()), enable_timing=enable_timing,
                       blocking=blocking, interprocess=interprocess)
