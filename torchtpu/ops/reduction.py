"""Reductions: sums, means, variances, extrema, norms, logical reductions.

Conventions shared by every lowering here, as ATen defines them:

- `dim=None` and an empty dim list reduce every dimension; negative dims count from the end;
  a 0-dim tensor accepts dim 0 or -1 and reduces over nothing.
- Sums, products, means, variances and norms accumulate in PyTorch's "opmath" dtype (float32 for
  bfloat16/float16, the output dtype otherwise); integer sums accumulate in int64 and wrap around
  as the CPU kernels do. A `dtype=` argument converts the input before the reduction.
- Extrema propagate NaN; `max.dim`/`argmax` and friends return the first index of the extremum
  (or of the first NaN), from one variadic XLA reduction that yields values and indices together.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops import registry

aten = torch.ops.aten

_LOW_PRECISION = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def axes(ndim: int, dim: int | Sequence[int] | None) -> tuple[int, ...]:
    """The non-negative, sorted axes a reduction over `dim` covers (None or [] = every axis)."""
    if ndim == 0:
        return ()
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    if len(dim) == 0:
        return tuple(range(ndim))
    return tuple(sorted({d % ndim for d in dim}))


def opmath(dtype) -> np.dtype:
    """The dtype PyTorch's CPU kernels compute `dtype` results in (float32 for bf16/f16)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in _LOW_PRECISION else dtype


def _count(x, reduced: tuple[int, ...]) -> int:
    return math.prod(x.shape[a] for a in reduced)


# --- sums, products, means --------------------------------------------------------------------


@registry.register(aten.sum.dim_IntList)
def sum_dim(ctx, x, dim, keepdim=False, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    return jnp.sum(x, axes(x.ndim, dim), keepdims=keepdim)


@registry.register(aten.nansum.default)
def nansum(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return jnp.sum(x, axes(x.ndim, dim), keepdims=keepdim)


@registry.register(aten.prod.dim_int, aten.prod.default)
def prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    return jnp.prod(x, axes(x.ndim, dim), keepdims=keepdim)


@registry.register(aten.mean.dim, aten.mean.default)
def mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    reduced = axes(x.ndim, dim)
    return jnp.sum(x, reduced, keepdims=keepdim) / _count(x, reduced)


@registry.register(aten.logsumexp.default)
def logsumexp(ctx, x, dim, keepdim=False):
    """log(sum(exp(x))) shifted by the finite maximum for range, as ATen computes it."""
    x = x.astype(opmath(ctx.out_dtype()))
    reduced = axes(x.ndim, dim)
    if x.size == 0:
        return jnp.log(jnp.sum(jnp.exp(x), reduced, keepdims=keepdim))
    shift = jnp.max(x, reduced, keepdims=True)
    shift = jnp.where(jnp.isinf(shift), jnp.zeros((), x.dtype), shift)
    total = jnp.log(jnp.sum(jnp.exp(x - shift), reduced, keepdims=keepdim))
    return total + (shift if keepdim else jnp.squeeze(shift, reduced))


# --- variance and standard deviation ----------------------------------------------------------


def _moments(ctx, x, dim, correction, keepdim):
    """(variance, mean) with Bessel-style `correction` (default 1), in opmath."""
    x = x.astype(opmath(ctx.out_dtype()))
    reduced = axes(x.ndim, dim)
    n = _count(x, reduced)
    mean_kept = jnp.sum(x, reduced, keepdims=True) / n
    squares = jnp.sum(jnp.square(x - mean_kept), reduced, keepdims=keepdim)
    correction = 1 if correction is None else correction
    var = squares / max(n - correction, 0)
    mean = mean_kept if keepdim else jnp.squeeze(mean_kept, reduced)
    return var, mean


@registry.register(aten.var.correction)
def var(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _moments(ctx, x, dim, correction, keepdim)[0]


@registry.register(aten.std.correction)
def std(ctx, x, dim=None, *, correction=None, keepdim=False):
    return jnp.sqrt(_moments(ctx, x, dim, correction, keepdim)[0])


@registry.register(aten.var_mean.correction)
def var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _moments(ctx, x, dim, correction, keepdim)


@registry.register(aten.std_mean.correction)
def std_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    var, mean = _moments(ctx, x, dim, correction, keepdim)
    return jnp.sqrt(var), mean


# --- extrema ----------------------------------------------------------------------------------


def _comparable(x):
    """Bool tensors compare as uint8 (XLA has no ordering on predicates)."""
    return x.astype(np.uint8) if x.dtype == np.bool_ else x


@registry.register(aten.amax.default, aten.max.default)
def amax(ctx, x, dim=(), keepdim=False):
    return jnp.max(_comparable(x), axes(x.ndim, dim), keepdims=keepdim)


@registry.register(aten.amin.default, aten.min.default)
def amin(ctx, x, dim=(), keepdim=False):
    return jnp.min(_comparable(x), axes(x.ndim, dim), keepdims=keepdim)


@registry.register(aten.aminmax.default)
def aminmax(ctx, x, *, dim=None, keepdim=False):
    reduced = axes(x.ndim, dim)
    x = _comparable(x)
    return jnp.min(x, reduced, keepdims=keepdim), jnp.max(x, reduced, keepdims=keepdim)


def _lowest(dtype, largest: bool):
    """The identity of a max (largest) or min selection over `dtype`."""
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf if largest else np.inf
    info = jnp.iinfo(dtype)
    return info.min if largest else info.max


def select(x, axis: int | None, keepdim: bool, largest: bool):
    """(values, indices) of the max (`largest`) or min along `axis` (None: over all elements).

    Ties go to the first index; NaN beats every number and the first NaN wins, so NaN
    propagates with its index, as in ATen's CPU kernels.
    """
    x = _comparable(x)
    kept_shape = tuple(1 if axis is None or a == axis else s for a, s in enumerate(x.shape))
    if axis is None:
        x, axis = x.reshape(-1), 0
    index = lax.broadcasted_iota(np.int64, x.shape, axis)
    floating = jnp.issubdtype(x.dtype, jnp.floating)

    def pick(a, b):
        (av, ai), (bv, bi) = a, b
        beats = av > bv if largest else av < bv
        first = ai < bi
        take_a = beats | ((av == bv) & first)
        if floating:
            a_nan, b_nan = jnp.isnan(av), jnp.isnan(bv)
            take_a = jnp.where(a_nan, ~b_nan | first, take_a & ~b_nan)
        return jnp.where(take_a, av, bv), jnp.where(take_a, ai, bi)

    init = (jnp.asarray(_lowest(x.dtype, largest), x.dtype), jnp.asarray(np.iinfo(np.int64).max))
    values, indices = lax.reduce((x, index), init, pick, (axis,))
    if keepdim:
        values, indices = values.reshape(kept_shape), indices.reshape(kept_shape)
    return values, indices


def _single_axis(x, dim: int | None) -> int | None:
    return None if dim is None or x.ndim == 0 else dim % x.ndim


@registry.register(aten.max.dim)
def max_dim(ctx, x, dim, keepdim=False):
    return select(x, _single_axis(x, dim), keepdim, largest=True)


@registry.register(aten.min.dim)
def min_dim(ctx, x, dim, keepdim=False):
    return select(x, _single_axis(x, dim), keepdim, largest=False)


@registry.register(aten.argmax.default)
def argmax(ctx, x, dim=None, keepdim=False):
    return select(x, _single_axis(x, dim), keepdim, largest=True)[1]


@registry.register(aten.argmin.default)
def argmin(ctx, x, dim=None, keepdim=False):
    return select(x, _single_axis(x, dim), keepdim, largest=False)[1]


# --- logical reductions and counts --------------------------------------------------------------


def _truth(x):
    return x if x.dtype == np.bool_ else x != 0


def _logical_axes(x, dim) -> tuple[int, ...]:
    """any/all differ from the other reductions: an empty dim list reduces nothing."""
    return () if isinstance(dim, (tuple, list)) and not dim else axes(x.ndim, dim)


@registry.register(aten.any.default, aten.any.dim, aten.any.dims)
def any_(ctx, x, dim=None, keepdim=False):
    return jnp.any(_truth(x), _logical_axes(x, dim), keepdims=keepdim)


@registry.register(aten.all.default, aten.all.dim, aten.all.dims)
def all_(ctx, x, dim=None, keepdim=False):
    return jnp.all(_truth(x), _logical_axes(x, dim), keepdims=keepdim)


@registry.register(aten.count_nonzero.dim_IntList)
def count_nonzero(ctx, x, dim):
    return jnp.sum(_truth(x).astype(np.int64), axes(x.ndim, dim))


# --- norms ------------------------------------------------------------------------------------


def vector_norm(x, ord: float, reduced: tuple[int, ...], keepdim: bool):
    """The `ord`-norm of `x` over `reduced` (already in the compute dtype)."""
    magnitude = jnp.abs(x)
    if ord == math.inf:
        return jnp.max(magnitude, reduced, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(magnitude, reduced, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((x != 0).astype(x.dtype), reduced, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(magnitude, reduced, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(jnp.square(magnitude), reduced, keepdims=keepdim))
    return jnp.sum(magnitude**ord, reduced, keepdims=keepdim) ** (1.0 / ord)


@registry.register(aten.linalg_vector_norm.default)
def linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    return vector_norm(x, float(ord), axes(x.ndim, dim), keepdim)


@registry.register(aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype)
def norm(ctx, x, p=None, dim=(), keepdim=False, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    return vector_norm(x, 2.0 if p is None else float(p), axes(x.ndim, dim), keepdim)
