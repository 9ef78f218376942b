"""Device memory of the CPU stand-in: freed blocks stay in the process for reuse, as on a device.

On the CPU stand-in, PJRT takes every device buffer, and every program's scratch space, from the
host's malloc. glibc gives a large block its own mmap and unmaps it when it is freed, trims the
heap's free top, and gives threads arenas of their own; so a training loop that frees and
allocates the same buffers every step pays the kernel's first-touch page faults on all of them,
every step: about 25,000 faults and 35 ms of kernel time in a DLRM-DCN step of 95 ms (2 cores).
A TPU's allocator keeps its device memory instead. `install` makes glibc do the same for the
stand-in: large blocks come from the heap (no mmap), the heap is never trimmed, and one arena
serves every thread (a block freed by one XLA worker is reused by the next that allocates). The
process then keeps its peak memory, as a device's memory pool does.

The runtime installs it before JAX starts its threads, on glibc hosts without a TPU runtime
(`libtpu`), and takes back the heap settings if the platform still turns out to be a TPU
(UNTESTED: no TPU here), whose device memory is not the host's. `TORCHTPU_HOST_MEMORY_POOL=0`
keeps glibc's behaviour.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os

__all__ = ["install", "installed", "trim", "uninstall"]

_ENV = "TORCHTPU_HOST_MEMORY_POOL"
# mallopt parameters (glibc's malloc.h) and glibc's defaults for them.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}
_POOL = {_M_TRIM_THRESHOLD: 2**31 - 1, _M_MMAP_MAX: 0, _M_ARENA_MAX: 1}

_installed = False


def _wanted() -> bool:
    value = os.environ.get(_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _mallopt():
    """glibc's `mallopt`, or None on another C library."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
        return libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None


def _apply(settings: dict[int, int]) -> bool:
    mallopt = _mallopt()
    if mallopt is None:
        return False
    applied = [mallopt(parameter, value) == 1 for parameter, value in settings.items()]
    return all(applied)


def install() -> bool:
    """Keep freed host memory in the process (see the module docstring); whether it applies."""
    global _installed
    if not _installed and _wanted() and importlib.util.find_spec("libtpu") is None:
        _installed = _apply(_POOL)
    return _installed


def uninstall() -> None:
    """glibc's defaults again for large blocks and trimming (for a process whose device is not
    host memory). The one arena stays: glibc fixes the arena count at first use."""
    global _installed
    if _installed:
        _apply(_DEFAULTS)
        _installed = False


def installed() -> bool:
    return _installed


def trim() -> bool:
    """Give the heap's free memory back to the kernel (`torch.tpu.empty_cache`): glibc's
    `malloc_trim(0)`, which unmaps the free top and releases the pages of free blocks inside the
    heap. Later allocations fault those pages in again. Whether anything was released; False
    without glibc or without the pool (glibc then trims by itself)."""
    if not _installed:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return libc.malloc_trim(ctypes.c_size_t(0)) == 1
