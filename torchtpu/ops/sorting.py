"""Sorting, selection (top-k, k-th value, medians, mode), scans, binary search and bincount.

Everything that orders values goes through one stable XLA sort (`sort_along`) with PyTorch's
order: NaN counts as the largest value (last ascending, first descending), -0.0 equals 0.0, and
equal values keep their original order, so indices are deterministic. Top-k is that sort followed
by a slice, a pattern XLA rewrites into its TopK kernel on TPU.

Scans accumulate in PyTorch's opmath dtype; `cummax`/`cummin` follow ATen's CPU rule: ties take
the later index, and a NaN, once met, stays (with the index of the latest NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.promotion import DEFAULT
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


def _axis(x, dim: int) -> int:
    return dim % x.ndim


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _sort_keys(x, descending: bool) -> tuple:
    """Sort keys whose ascending lexicographic order is PyTorch's order of `x`."""
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    if not descending:
        return (x,)
    if _floating(x):
        return (jnp.where(jnp.isnan(x), 0, 1).astype(np.uint8), -x)
    return (~x,)


def sort_along(x, axis: int, descending: bool = False):
    """(values, int64 indices) of a stable sort of `x` along `axis`."""
    keys = _sort_keys(x, descending)
    index = lax.broadcasted_iota(np.int64, x.shape, axis)
    *_, values, indices = lax.sort((*keys, x, index), dimension=axis, is_stable=True, num_keys=len(keys))
    return values, indices


@registry.register(aten.sort.default, aten.sort.stable)
def sort(ctx, x, dim=-1, descending=False, *, stable=False):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    return sort_along(x, _axis(x, dim), descending)


@registry.register(aten.topk.default)
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    axis = _axis(x, dim)
    values, indices = sort_along(x, axis, descending=largest)
    return lax.slice_in_dim(values, 0, k, axis=axis), lax.slice_in_dim(indices, 0, k, axis=axis)


def _take(values, indices, position, axis: int, keepdim: bool):
    """values/indices at `position` (a scalar or an array with `axis` kept) along `axis`."""
    position = jnp.broadcast_to(jnp.asarray(position), values.shape[:axis] + (1,) + values.shape[axis + 1:])
    picked = (jnp.take_along_axis(values, position, axis), jnp.take_along_axis(indices, position, axis))
    return picked if keepdim else tuple(jnp.squeeze(p, axis) for p in picked)


@registry.register(aten.kthvalue.default)
def kthvalue(ctx, x, k, dim=-1, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    axis = _axis(x, dim)
    values, indices = sort_along(x, axis)
    return _take(values, indices, k - 1, axis, keepdim)


def _median(x, axis: int, keepdim: bool, ignore_nan: bool):
    """Lower median along `axis`: NaN propagates (median) or is skipped (nanmedian)."""
    values, indices = sort_along(x, axis)
    n = x.shape[axis]
    if not _floating(x):
        return _take(values, indices, (n - 1) // 2, axis, keepdim)
    nans = jnp.sum(jnp.isnan(x), axis, keepdims=True)
    if ignore_nan:
        position = jnp.maximum((n - nans - 1) // 2, 0)
    else:
        position = jnp.where(nans > 0, n - nans, (n - 1) // 2)
    return _take(values, indices, position, axis, keepdim)


def _median_dim(ctx, x, dim, keepdim, ignore_nan):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    return _median(x, _axis(x, dim), keepdim, ignore_nan)


def _median_all(ctx, x, ignore_nan):
    if x.size == 0:
        return jnp.full((), np.nan, x.dtype)
    return _median(x.reshape(-1), 0, False, ignore_nan)[0]


@registry.register(aten.median.dim)
def median_dim(ctx, x, dim, keepdim=False):
    return _median_dim(ctx, x, dim, keepdim, ignore_nan=False)


@registry.register(aten.nanmedian.dim)
def nanmedian_dim(ctx, x, dim, keepdim=False):
    return _median_dim(ctx, x, dim, keepdim, ignore_nan=True)


@registry.register(aten.median.default)
def median(ctx, x):
    return _median_all(ctx, x, ignore_nan=False)


@registry.register(aten.nanmedian.default)
def nanmedian(ctx, x):
    return _median_all(ctx, x, ignore_nan=True)


@registry.register(aten.mode.default)
def mode(ctx, x, dim=-1, keepdim=False):
    """Most frequent value (the smallest among equally frequent ones) and its last index."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    axis = _axis(x, dim)
    values, indices = sort_along(x, axis)
    n = x.shape[axis]
    position = lax.broadcasted_iota(np.int64, x.shape, axis)
    same_as_previous = jnp.concatenate(
        [jnp.zeros_like(lax.slice_in_dim(values, 0, 1, axis=axis), bool),
         _equal(lax.slice_in_dim(values, 1, n, axis=axis), lax.slice_in_dim(values, 0, n - 1, axis=axis))],
        axis=axis,
    )
    run_start = lax.cummax(jnp.where(same_as_previous, 0, position), axis=axis)
    run_length = position - run_start + 1
    # The longest run ends where its length is largest; the first such end is the smallest value.
    end = jnp.argmax(run_length, axis=axis, keepdims=True)
    # Among equal values, the last in stable order has the largest original index.
    return _take(values, indices, end, axis, keepdim)


def _equal(a, b):
    """Elementwise equality that treats NaN as equal to NaN (one run of NaNs)."""
    if jnp.issubdtype(a.dtype, jnp.floating):
        return (a == b) | (jnp.isnan(a) & jnp.isnan(b))
    return a == b


# --- scans ------------------------------------------------------------------------------------


@registry.register(aten.cumsum.default)
def cumsum(ctx, x, dim, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    return x if x.ndim == 0 else lax.cumsum(x, _axis(x, dim))


@registry.register(aten.cumprod.default)
def cumprod(ctx, x, dim, *, dtype=None):
    x = x.astype(opmath(ctx.out_dtype()))
    return x if x.ndim == 0 else lax.cumprod(x, _axis(x, dim))


@registry.register(aten.logcumsumexp.default, aten._logcumsumexp.default)
def logcumsumexp(ctx, x, dim):
    x = x.astype(opmath(ctx.out_dtype()))
    return x if x.ndim == 0 else lax.cumlogsumexp(x, _axis(x, dim))


def _cumulative_select(x, dim: int, largest: bool):
    """Running max (min) and its index: ties and every NaN take the later index, and once a NaN
    is met no number replaces it (the selection is by a total order, so the scan is associative)."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    axis = _axis(x, dim)
    keys = x.astype(np.uint8) if x.dtype == np.bool_ else x
    index = lax.broadcasted_iota(np.int64, x.shape, axis)
    floating = _floating(x)

    def combine(earlier, later):
        (ev, ei), (lv, li) = earlier, later
        take_later = lv >= ev if largest else lv <= ev
        if floating:
            take_later = jnp.isnan(lv) | (~jnp.isnan(ev) & take_later)
        return jnp.where(take_later, lv, ev), jnp.where(take_later, li, ei)

    values, indices = lax.associative_scan(combine, (keys, index), axis=axis)
    return values.astype(x.dtype), indices


@registry.register(aten.cummax.default)
def cummax(ctx, x, dim):
    return _cumulative_select(x, dim, largest=True)


@registry.register(aten.cummin.default)
def cummin(ctx, x, dim):
    return _cumulative_select(x, dim, largest=False)


# --- binary search and counting -------------------------------------------------------------


def _search(boundaries, values, right: bool):
    """Insertion points of `values` into rows of sorted `boundaries` (1-D: one row for all)."""
    side = "right" if right else "left"
    if values.size == 0 or boundaries.shape[-1] == 0:
        return jnp.zeros(values.shape, np.int64)
    if boundaries.ndim == 1:
        return jnp.searchsorted(boundaries, values, side=side)
    rows = boundaries.reshape(-1, boundaries.shape[-1])
    queries = values.reshape(rows.shape[0], -1)
    found = jax.vmap(lambda row, q: jnp.searchsorted(row, q, side=side))(rows, queries)
    return found.reshape(values.shape)


@registry.register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(ctx, sorted_sequence, x, *, out_int32=False, right=False, side=None, sorter=None):
    compute, _ = ctx.promotion(DEFAULT, "sorted_sequence", "self")
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    found = _search(sorted_sequence.astype(compute), jnp.asarray(x, compute), right or side == "right")
    return found.astype(ctx.out_dtype())


@registry.register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(ctx, x, boundaries, *, out_int32=False, right=False):
    compute, _ = ctx.promotion(DEFAULT, "self", "boundaries")
    found = _search(boundaries.astype(compute), jnp.asarray(x, compute), right)
    return found.astype(ctx.out_dtype())


@registry.register_data_dependent(aten.bincount.default)
def bincount(x: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """Counts of each value of a 1-D non-negative integer tensor (weighted: sums of `weights`).

    The length, max(x) + 1 or `minlength`, is read to the host once; the counts are then a
    static-shape scatter-add. Weighted counts are float32 for float32 weights, else float64.
    """
    if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise RuntimeError(f"bincount only supports 1-d non-negative integral inputs, got {x.dim()}-d {x.dtype}")
    if minlength < 0:
        raise RuntimeError(f"bincount: minlength should be >= 0, got {minlength}")
    if weights is not None and weights.shape != x.shape:
        raise RuntimeError(
            f"bincount: weights should be 1-d and have the same length as input, "
            f"got weights of shape {tuple(weights.shape)} for input of shape {tuple(x.shape)}"
        )
    length = minlength
    if x.numel():
        low, high = (int(v.item()) for v in torch.aminmax(x))  # one program, two reads
        if low < 0:
            raise RuntimeError(f"bincount only supports 1-d non-negative integral inputs, got a value {low}")
        length = max(length, high + 1)
    if weights is None:
        counts = torch.zeros(length, dtype=torch.int64, device=x.device)
        return counts.scatter_add_(0, x, torch.ones_like(x, dtype=torch.int64))
    dtype = torch.float32 if weights.dtype == torch.float32 else torch.float64
    counts = torch.zeros(length, dtype=dtype, device=x.device)
    return counts.scatter_add_(0, x, weights.to(dtype))

