"""The tpu device guard: each thread's current device, and the device count PyTorch sees.

PyTorch's Python PrivateUse1 device guard (`torch._C._acc.DeviceGuard`) reports one device and
ignores `set_device`. The autograd engine sizes its per-device ready queues by that count, so with
it a backward pass on `tpu:1` fails an internal assert, and `torch.device("tpu")` could never mean
anything but `tpu:0`. `csrc/device_guard.cpp` is a complete guard in a few lines of C++; this
module builds it once per torch build (`torchtpu.native`) and loads it before the Python
registration, which is first-wins. The same library registers the PrivateUse1 allocator:
PyTorch asks it for storage it allocates itself (`torch.UntypedStorage(n, device="tpu")`) and for
`torch.accelerator`'s memory API. The guard's synchronisation, events and streams and the
allocator's memory figures are the Python runtime's, handed over as `RuntimeHooks`.

Without a C++ compiler the Python guard stays, with a warning: everything works on `tpu:0`, and a
backward pass on another device index fails; without the allocator, `torch.UntypedStorage(n,
device="tpu")` crashes and `torch.accelerator`'s memory functions fail (`torch.tpu`'s work).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import warnings
from typing import Any, Callable

from torchtpu import native

# Device count the autograd engine sees if its first backward pass runs before the runtime has
# started (it reads the count once): enough for every TPU host's chips.
_PROVISIONAL_COUNT = 8

_library: ctypes.CDLL | None = None


def install() -> bool:
    """Build (once) and register the C++ guard for PrivateUse1; False if it could not be."""
    global _library
    if _library is not None:
        return True
    try:
        library = native.load("device_guard")
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"torchtpu could not build its device guard ({error}); falling back to PyTorch's "
            "Python device guard, which knows one device: backward passes on tpu:1 and above "
            "will fail, and without its allocator torch.UntypedStorage(n, device='tpu') crashes "
            "and torch.accelerator's memory functions fail (torch.tpu's work). Install a C++ "
            "compiler (g++) to lift this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    library.torchtpu_current_device.restype = ctypes.c_int
    library.torchtpu_set_device_count(int(os.environ.get("TORCHTPU_NUM_DEVICES") or _PROVISIONAL_COUNT))
    _library = library
    return True


@dataclasses.dataclass(frozen=True)
class RuntimeHooks:
    """What the C++ guard and allocator run for PyTorch's device API (`torch.accelerator`,
    `torch.Event`, `torch.Stream`): the Python runtime's answers (torchtpu.device, torchtpu.events)."""

    synchronize: Callable[[int], None]  # (device)
    record_event: Callable[[int, int, bool], int]  # (device, event or 0 for a new one, timing) -> event
    query_event: Callable[[int], bool]
    synchronize_event: Callable[[int], None]
    destroy_event: Callable[[int], None]
    elapsed_time: Callable[[int, int], float]  # (start, end) -> milliseconds
    memory_stats: Callable[[int], tuple[int, int]]  # (device) -> (allocated, peak) bytes
    reset_peak_memory_stats: Callable[[int], None]
    empty_cache: Callable[[], None]
    memory_info: Callable[[int], tuple[int, int]]  # (device) -> (free, total) bytes


_Error = (ctypes.c_void_p, ctypes.c_size_t)  # every call's buffer for its error's message
_Int64Out = ctypes.POINTER(ctypes.c_int64)


class _Callbacks(ctypes.Structure):
    """csrc/device_guard.cpp's `RuntimeCallbacks`, field for field."""

    _fields_ = [
        ("synchronize_device", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, *_Error)),
        ("record_event", ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int, *_Error)),
        ("query_event", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, *_Error)),
        ("synchronize_event", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, *_Error)),
        ("destroy_event", ctypes.CFUNCTYPE(None, ctypes.c_int64)),
        ("elapsed_time", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.POINTER(ctypes.c_double), *_Error)),
        ("memory_stats", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, _Int64Out, _Int64Out, *_Error)),
        ("reset_peak_memory_stats", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, *_Error)),
        ("empty_cache", ctypes.CFUNCTYPE(ctypes.c_int, *_Error)),
        ("memory_info", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, _Int64Out, _Int64Out, *_Error)),
    ]


_callbacks: _Callbacks | None = None  # kept alive with the library, which calls them


def _reporting(fn: Callable[..., int | None]) -> Callable[..., int]:
    """`fn(*args)` for C++: its result (0 for None), or -1 with its error's message written into
    the caller's buffer (which raises it as a RuntimeError)."""

    def run(*args):
        *args, error, size = args
        try:
            return fn(*args) or 0
        except Exception as exc:  # noqa: BLE001  (every error goes back to the caller, as a message)
            message = f"{type(exc).__name__}: {exc}".encode()[: size - 1]
            ctypes.memmove(error, message, len(message))
            return -1

    return run


def _pair(fn: Callable[[int], tuple[int, int]]) -> Callable[[int, Any, Any], None]:
    """`fn(device)`'s two numbers written into C++'s two out-parameters."""

    def write(device, first, second):
        first[0], second[0] = fn(device)

    return write


def _out(fn: Callable[[int, int], float]) -> Callable[[int, int, Any], None]:
    """`fn(a, b)`'s number written into C++'s out-parameter."""

    def write(a, b, result):
        result[0] = fn(a, b)

    return write


def set_runtime(hooks: RuntimeHooks) -> None:
    """Hand `hooks` to the C++ guard and allocator (nothing to do without them)."""
    global _callbacks
    if _library is None:
        return
    fields = dict(_Callbacks._fields_)
    _callbacks = _Callbacks(
        fields["synchronize_device"](_reporting(hooks.synchronize)),
        fields["record_event"](_reporting(lambda device, event, timed: hooks.record_event(device, event, timed != 0))),
        fields["query_event"](_reporting(lambda event: int(hooks.query_event(event)))),
        fields["synchronize_event"](_reporting(hooks.synchronize_event)),
        fields["destroy_event"](hooks.destroy_event),
        fields["elapsed_time"](_reporting(_out(hooks.elapsed_time))),
        fields["memory_stats"](_reporting(_pair(hooks.memory_stats))),
        fields["reset_peak_memory_stats"](_reporting(hooks.reset_peak_memory_stats)),
        fields["empty_cache"](_reporting(hooks.empty_cache)),
        fields["memory_info"](_reporting(_pair(hooks.memory_info))),
    )
    _library.torchtpu_set_runtime_callbacks(ctypes.byref(_callbacks))


def set_device_count(count: int) -> None:
    """Publish the runtime's device count (called once the runtime has started)."""
    if _library is not None:
        _library.torchtpu_set_device_count(count)
        _library.torchtpu_set_runtime_started()


def current_device() -> int:
    return _library.torchtpu_current_device() if _library is not None else _fallback_current.index


def set_current_device(index: int) -> None:
    if _library is not None:
        _library.torchtpu_set_current_device(index)
    else:
        _fallback_current.index = index


class _FallbackCurrent(threading.local):
    index = 0


_fallback_current = _FallbackCurrent()
