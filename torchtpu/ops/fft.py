"""FFT lowerings: ATen's three FFT primitives on `jnp.fft` (XLA's FFT).

Every `torch.fft` function reaches one of them, after PyTorch's front end has padded or trimmed
the input to the signal sizes (`n=`, `s=`) and chosen the dims:

- `_fft_r2c(self, dim, normalization, onesided)`: forward transform of a real tensor; with
  `onesided` the last of `dim` keeps its `n // 2 + 1` non-redundant frequencies;
- `_fft_c2r(self, dim, normalization, last_dim_size)`: inverse of a Hermitian-symmetric one-sided
  spectrum to a real tensor whose last transformed dim has `last_dim_size` elements;
- `_fft_c2c(self, dim, normalization, forward)`: complex to complex, either direction.

The transforms are unnormalised; `normalization` is ATen's `fft_norm_mode`: 0 none, 1 by
1/sqrt(n), 2 by 1/n, where n is the number of elements of the signal (the product of the
transformed dims' sizes of the complex-to-complex, the real input's or the real output's).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops import registry

aten = torch.ops.aten

_NONE, _BY_ROOT_N, _BY_N = 0, 1, 2


def _normalized(x, signal_numel: int, normalization: int):
    """`x` scaled as ATen's `fft_norm_mode` `normalization` says."""
    if normalization == _NONE:
        return x
    if normalization == _BY_ROOT_N:
        factor = 1 / math.sqrt(signal_numel)
    elif normalization == _BY_N:
        factor = 1 / signal_numel
    else:
        raise ValueError(f"FFT normalization must be 0 (none), 1 (by 1/sqrt(n)) or 2 (by 1/n), got {normalization}")
    return x * jnp.asarray(factor, jnp.real(x).dtype)


def _axes(dim: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(d % ndim for d in dim)


def _signal_numel(shape: Sequence[int], axes: Sequence[int]) -> int:
    return math.prod(shape[a] for a in axes)


@registry.register(aten._fft_r2c.default)
def fft_r2c(ctx, x, dim, normalization, onesided):
    """Forward FFT of a real tensor over `dim` (one-sided over the last of `dim`)."""
    axes = _axes(dim, x.ndim)
    if onesided:
        out = jnp.fft.rfftn(x, axes=axes, norm="backward")
    else:
        out = jnp.fft.fftn(x.astype(ctx.out_dtype()), axes=axes, norm="backward")
    return _normalized(out.astype(ctx.out_dtype()), _signal_numel(x.shape, axes), normalization)


@registry.register(aten._fft_c2r.default)
def fft_c2r(ctx, x, dim, normalization, last_dim_size):
    """Inverse FFT of a one-sided Hermitian spectrum to a real tensor over `dim`, the last of
    which has `last_dim_size` elements in the output."""
    axes = _axes(dim, x.ndim)
    sizes = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    out = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _normalized(out.astype(ctx.out_dtype()), math.prod(sizes), normalization)


@registry.register(aten._fft_c2c.default)
def fft_c2c(ctx, x, dim, normalization, forward):
    """Complex FFT over `dim`: forward (exponent -2 pi i) or inverse (+2 pi i), unnormalised
    before `normalization`."""
    axes = _axes(dim, x.ndim)
    if not axes:
        return x
    transform = jnp.fft.fftn if forward else jnp.fft.ifftn
    out = transform(x, axes=axes, norm="backward" if forward else "forward")
    return _normalized(out.astype(ctx.out_dtype()), _signal_numel(x.shape, axes), normalization)


registry.allow_complex(aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default)


# --- sample frequencies ------------------------------------------------------------------------


def _frequencies(ctx, integers: np.ndarray, n: int, d: float):
    """`integers / (n * d)` as ATen computes it: the integers in the result's dtype times the
    reciprocal (rounded to that dtype), not a division."""
    out = ctx.out_dtype()
    return jnp.asarray(integers, out) * jnp.asarray(1.0 / (n * d), out)


@registry.register(aten.fft_fftfreq.default)
def fft_fftfreq(ctx, n, d=1.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.fft.fftfreq`: 0, 1, ..., then the negative frequencies, over `n * d`. (Eager mode ran
    PyTorch's composite, which compiled graphs keep whole: they were split.)"""
    return _frequencies(ctx, np.concatenate([np.arange((n + 1) // 2), np.arange(-(n // 2), 0)]), n, d)


@registry.register(aten.fft_rfftfreq.default)
def fft_rfftfreq(ctx, n, d=1.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.fft.rfftfreq`: the `n // 2 + 1` non-negative frequencies over `n * d`."""
    return _frequencies(ctx, np.arange(n // 2 + 1), n, d)
