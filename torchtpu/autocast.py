"""Autocast on tpu: `torch.autocast("tpu")`, in bfloat16 unless another dtype is given.

PyTorch casts under autocast in a dispatch key of each device and fills it only for its own
devices; `csrc/autocast.cpp` registers CUDA's cast policy for tpu (matmuls and convolutions in
the autocast dtype, accuracy-sensitive ops in float32, mixed inputs promoted). This module builds
it once per torch build (`torchtpu.native`) and loads it when torchtpu registers the device, and
makes bfloat16 -- the TPU's native 16-bit type -- the default autocast dtype of tpu (CUDA's is
float16).

Without a C++ compiler there is no autocast on tpu: `supported_dtypes()` is empty, so
`torch.autocast("tpu")` warns that the dtype is unsupported and disables itself.
"""

from __future__ import annotations

import warnings

import torch

from torchtpu import native

_installed = False


def install() -> bool:
    """Build (once) and load the autocast registrations; False if they could not be."""
    global _installed
    if _installed:
        return True
    try:
        native.load("autocast")
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"torchtpu could not build its autocast registrations ({error}); torch.autocast('tpu') "
            "will disable itself. Install a C++ compiler (g++) to lift this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    torch.set_autocast_dtype("tpu", torch.bfloat16)
    _installed = True
    return True


def supported_dtypes() -> list[torch.dtype]:
    """The dtypes `torch.autocast("tpu", dtype=...)` runs in."""
    return [torch.bfloat16, torch.float16] if _installed else []
