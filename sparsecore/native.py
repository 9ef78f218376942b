"""Building sparsecore's C++ sources into shared libraries, once per source and machine.

A source compiles (`-O3`, C++17, threads) into a shared library in a cache directory
(`$SPARSECORE_CACHE_DIR`, else `~/.cache/sparsecore`), named by a hash of the source, the build
stamp (jaxlib's version for code built against its headers) and the platform, under a file lock
so that concurrent processes build it once. Users: the stand-in's XLA custom calls
(`sparsecore.kernels.native`) and compiled host preprocessing (`sparsecore.preprocess.native`).
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
from collections.abc import Sequence
from pathlib import Path

__all__ = ["library"]


def _cache_dir() -> Path:
    root = os.environ.get("SPARSECORE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sparsecore"
    )
    return Path(root)


def _compile(source: Path, include_dirs: Sequence[str], target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (c++ or g++ on PATH, or $CXX)")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    includes = [f"-I{d}" for d in include_dirs]
    command = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", *includes, str(source), "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {source.name} failed:\n{result.stderr[-2000:]}")
    partial.replace(target)


@functools.cache
def library(source: Path, include_dirs: tuple[str, ...] = (), stamp: str = "") -> ctypes.CDLL:
    """The shared library of C++ `source`, built on first use. Raises OSError (no compiler, a
    library that does not load) or RuntimeError (a failed build)."""
    key = source.read_bytes() + f"{stamp} {sysconfig.get_platform()}".encode()
    target = _cache_dir() / f"{source.stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                # A build cut short (its process killed) leaves its partial output; whoever
                # holds the lock removes it.
                for partial in target.parent.glob(f"{target.stem}.*.tmp"):
                    partial.unlink(missing_ok=True)
                _compile(source, include_dirs, target)
    return ctypes.CDLL(str(target))
