"""Building and loading torchtpu's C++ sources (`torchtpu/csrc`), once per torch build.

Each source compiles into a shared library in a cache directory (`$TORCHTPU_CACHE_DIR`, else
`~/.cache/torchtpu`), named by a hash of the source, the torch version and the platform (and
Python's ABI, for a library built against Python's headers), under a file lock so that
concurrent processes build it once; `import torchtpu` starts every build at once (`prebuild`).
Callers decide what to do without a compiler: each C++ piece has a Python fallback.
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
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"


def _cache_dir() -> Path:
    root = os.environ.get("TORCHTPU_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torchtpu"
    )
    return Path(root)


def _build(source: Path, target: Path, python: bool) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (c++ or g++ on PATH, or $CXX)")
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    includes = [f"-I{torch_dir / 'include'}"]
    libraries = ["-lc10", "-ltorch_cpu"]
    if python:  # Python's own symbols come from the interpreter that loads the library
        includes += [f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
                     f"-I{sysconfig.get_paths()['include']}"]
        libraries += ["-ltorch", "-ltorch_python"]
    command = [
        compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
        str(source), f"-L{torch_dir / 'lib'}", *libraries, f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {source.name} failed:\n{result.stderr[-2000:]}")
    partial.replace(target)


# The libraries of `csrc`, and whether each is compiled against Python's and torch's Python
# headers (then loaded as a `ctypes.PyDLL`, whose functions are called with the GIL held).
LIBRARIES = {"device_guard": False, "autocast": False, "fast_dispatch": True}


def load(name: str) -> ctypes.CDLL:
    """The library built from `csrc/<name>.cpp` (built first if needed; `prebuild` may have
    started it). Raises OSError or RuntimeError if it cannot be."""
    python = LIBRARIES[name]
    source, target = _source_and_target(name)
    _build_once(source, target, python)
    return (ctypes.PyDLL if python else ctypes.CDLL)(str(target))


def prebuild() -> None:
    """Start building every library not built yet, each on a thread of its own, so that a
    machine's first `import torchtpu` compiles them side by side rather than one after another
    (33 s -> 19 s, measured on two cores). `load` waits for a build under way (the file lock); a
    build that fails here leaves no library, and `load` builds it again and reports why."""
    for name, python in LIBRARIES.items():
        source, target = _source_and_target(name)
        if not target.exists():
            threading.Thread(target=_try_build_once, args=(source, target, python), daemon=True,
                             name=f"torchtpu-build-{name}").start()


def _source_and_target(name: str) -> tuple[Path, Path]:
    """`csrc/<name>.cpp`, and its library in the cache, named by a hash of the source, the torch
    version and the platform (and Python's ABI, for a library built against Python's headers)."""
    source = _CSRC / f"{name}.cpp"
    abi = f"{sysconfig.get_platform()} {sysconfig.get_config_var('SOABI') if LIBRARIES[name] else ''}"
    key = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + abi.encode()).hexdigest()[:16]
    return source, _cache_dir() / f"{name}-{key}.so"


def _build_once(source: Path, target: Path, python: bool) -> None:
    """Build `target` unless it exists, under a file lock: concurrent processes and threads
    build it once."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                # A build cut short (its process killed, or exiting while `prebuild`'s thread
                # compiled) leaves its partial output; whoever holds the lock removes it.
                for partial in target.parent.glob(f"{target.stem}.*.tmp"):
                    partial.unlink(missing_ok=True)
                _build(source, target, python)


def _try_build_once(source: Path, target: Path, python: bool) -> None:
    try:
        _build_once(source, target, python)
    except (OSError, RuntimeError):  # `load` builds it again and reports the error
        pass
