"""Building the stand-in's C++ custom calls (`kernels/csrc`) and registering them with XLA:CPU.

Each source compiles, against the XLA FFI headers that jaxlib ships, into a shared library in a
cache directory (`$SPARSECORE_CACHE_DIR`, else `~/.cache/sparsecore`), named by a hash of the
source, jaxlib's version and the platform, under a file lock so that concurrent processes build
it once. `register` makes the library's handlers XLA:CPU custom-call targets (once per process).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import jax
import jaxlib

_CSRC = Path(__file__).parent / "csrc"


def _cache_dir() -> Path:
    root = os.environ.get("SPARSECORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sparsecore"
    )
    return Path(root)


def _compile(source: Path, target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (c++ or g++ on PATH, or $CXX)")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [
        compiler, "-O3", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", str(source),
        "-o", str(partial),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {source.name} failed:\n{result.stderr[-2000:]}")
    partial.replace(target)


@functools.cache
def _library(name: str) -> ctypes.CDLL:
    source = _CSRC / f"{name}.cc"
    stamp = f"{jaxlib.__version__} {sysconfig.get_platform()}".encode()
    target = _cache_dir() / f"{name}-{hashlib.sha256(source.read_bytes() + stamp).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                _compile(source, target)
    return ctypes.CDLL(str(target))


@functools.cache
def register(name: str, handler: str) -> str:
    """The XLA:CPU custom-call target `sparsecore_<handler>` for the FFI handler symbol
    `handler` of `csrc/<name>.cc`, built and registered on first use. Raises OSError or
    RuntimeError when the library cannot be built or loaded."""
    target = f"sparsecore_{handler}"
    function = getattr(_library(name), handler)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(function), platform="cpu")
    return target
