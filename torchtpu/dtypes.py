"""The dtypes a `tpu` tensor may have, and their JAX equivalents."""

from __future__ import annotations

import numpy as np
import torch
import ml_dtypes

# torch dtype -> numpy dtype of the device buffer (jax uses numpy dtypes; bf16 from ml_dtypes).
_TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
_FROM_NUMPY: dict[np.dtype, torch.dtype] = {v: k for k, v in _TO_NUMPY.items()}

SUPPORTED: frozenset[torch.dtype] = frozenset(_TO_NUMPY)


def check_supported(dtype: torch.dtype) -> None:
    if dtype not in _TO_NUMPY:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in _TO_NUMPY))
        raise TypeError(f"dtype {dtype} is not supported on the tpu device (supported: {names})")


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The numpy/jax dtype for a torch dtype; TypeError for dtypes the device lacks."""
    try:
        return _TO_NUMPY[dtype]
    except KeyError:
        check_supported(dtype)
        raise


def from_jax(dtype) -> torch.dtype:
    return _FROM_NUMPY[np.dtype(dtype)]


def itemsize(dtype: torch.dtype) -> int:
    return _TO_NUMPY[dtype].itemsize


def aten_name(dtype: torch.dtype) -> str:
    """ATen's name of `dtype` in its error messages (`Long`, `BFloat16`, `ComplexFloat`), for
    lowerings that raise what a CPU kernel raises."""
    return torch.empty((), dtype=dtype, device="meta").type().rsplit(".", 1)[-1].removesuffix("Tensor")
