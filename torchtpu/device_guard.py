"""The tpu device guard: each thread's current device, and the device count PyTorch sees.

PyTorch's Python PrivateUse1 device guard (`torch._C._acc.DeviceGuard`) reports one device and
ignores `set_device`. The autograd engine sizes its per-device ready queues by that count, so with
it a backward pass on `tpu:1` fails an internal assert, and `torch.device("tpu")` could never mean
anything but `tpu:0`. `csrc/device_guard.cpp` is a complete guard in a few lines of C++; this
module compiles it once per torch build (into a cache directory, under a file lock so concurrent
processes build it once) and loads it before the Python registration, which is first-wins.

Without a C++ compiler the Python guard stays, with a warning: everything works on `tpu:0`, and a
backward pass on another device index fails.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sysconfig
import threading
import warnings
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "device_guard.cpp"
# Device count the autograd engine sees if its first backward pass runs before the runtime has
# started (it reads the count once): enough for every TPU host's chips.
_PROVISIONAL_COUNT = 8

_library: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    root = os.environ.get("TORCHTPU_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torchtpu"
    )
    return Path(root)


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (c++ or g++ on PATH, or $CXX)")
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [
        compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}", str(_SOURCE), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
        f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the tpu device guard failed:\n{result.stderr[-2000:]}")
    partial.replace(target)


def _library_path() -> Path:
    key = hashlib.sha256(
        _SOURCE.read_bytes() + torch.__version__.encode() + sysconfig.get_platform().encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"device_guard-{key}.so"


def install() -> bool:
    """Build (once) and register the C++ guard for PrivateUse1; False if it could not be."""
    global _library
    if _library is not None:
        return True
    target = _library_path()
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not target.exists():
                    _build(target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"torchtpu could not build its device guard ({error}); falling back to PyTorch's "
            "Python device guard, which knows one device: backward passes on tpu:1 and above "
            "will fail. Install a C++ compiler (g++) to lift this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    library.torchtpu_current_device.restype = ctypes.c_int
    library.torchtpu_set_device_count(int(os.environ.get("TORCHTPU_NUM_DEVICES") or _PROVISIONAL_COUNT))
    _library = library
    return True


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
