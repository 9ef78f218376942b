"""The stand-in's C++ custom calls (`kernels/csrc`), registered with XLA:CPU.

Each source is built against the XLA FFI headers that jaxlib ships (`sparsecore.native`, keyed
by jaxlib's version); `register` makes a library's handler an XLA:CPU custom-call target (once
per process).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jaxlib

from sparsecore import native

_CSRC = Path(__file__).parent / "csrc"


@functools.cache
def register(name: str, handler: str) -> str:
    """The XLA:CPU custom-call target `sparsecore_<handler>` for the FFI handler symbol
    `handler` of `csrc/<name>.cc`, built and registered on first use. Raises OSError or
    RuntimeError when the library cannot be built or loaded."""
    target = f"sparsecore_{handler}"
    library = native.library(_CSRC / f"{name}.cc", (jax.ffi.include_dir(),), f"jaxlib {jaxlib.__version__}")
    function = getattr(library, handler)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(function), platform="cpu")
    return target
