"""The tpu device guard: each thread's current device, and the device count PyTorch sees.

PyTorch's Python PrivateUse1 device guard (`torch._C._acc.DeviceGuard`) reports one device and
ignores `set_device`. The autograd engine sizes its per-device ready queues by that count, so with
it a backward pass on `tpu:1` fails an internal assert, and `torch.device("tpu")` could never mean
anything but `tpu:0`. `csrc/device_guard.cpp` is a complete guard in a few lines of C++; this
module builds it once per torch build (`torchtpu.native`) and loads it before the Python
registration, which is first-wins. The same library registers the PrivateUse1 allocator, whose
memory figures come from `torchtpu.device` (`set_memory_callbacks`): PyTorch asks it for storage
it allocates itself (`torch.UntypedStorage(n, device="tpu")`) and for `torch.accelerator`'s memory
API.

Without a C++ compiler the Python guard stays, with a warning: everything works on `tpu:0`, and a
backward pass on another device index fails; without the allocator, `torch.UntypedStorage(n,
device="tpu")` crashes and `torch.accelerator`'s memory functions fail (`torch.tpu`'s work).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import Callable

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


_MemoryStats = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64))
_OnDevice = ctypes.CFUNCTYPE(None, ctypes.c_int)
_Release = ctypes.CFUNCTYPE(None)
_MemoryInfo = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64))
_callbacks: tuple = ()  # the C functions handed to the library, kept alive with it


def set_memory_callbacks(stats: Callable[[int], tuple[int, int]], reset_peak: Callable[[int], None],
                         empty_cache: Callable[[], None], memory_info: Callable[[int], tuple[int, int]]) -> None:
    """What the PrivateUse1 allocator reports and does for `torch.accelerator`'s memory API:
    `stats(device)` -> (allocated, peak) bytes, `reset_peak(device)`, `empty_cache()`,
    `memory_info(device)` -> (free, total) bytes."""
    global _callbacks
    if _library is None:
        return

    def write_stats(device, allocated, peak):
        allocated[0], peak[0] = stats(device)

    def write_memory_info(device, free, total):
        free[0], total[0] = memory_info(device)

    _callbacks = (_MemoryStats(write_stats), _OnDevice(reset_peak), _Release(empty_cache),
                  _MemoryInfo(write_memory_info))
    _library.torchtpu_set_memory_callbacks(*_callbacks)


_Synchronize = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_synchronize: tuple = ()


def set_synchronize(synchronize: Callable[[int], None]) -> None:
    """What the C++ guard runs for `torch.accelerator.synchronize()`: `synchronize(device)`, whose
    error becomes the caller's RuntimeError."""
    global _synchronize
    if _library is None:
        return

    def run(device, error, size):
        try:
            synchronize(device)
        except Exception as exc:  # noqa: BLE001  (every error goes back to the caller, as a message)
            message = f"{type(exc).__name__}: {exc}".encode()[: size - 1]
            ctypes.memmove(error, message, len(message))
            return 1
        return 0

    _synchronize = (_Synchronize(run),)
    _library.torchtpu_set_synchronize(*_synchronize)


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
