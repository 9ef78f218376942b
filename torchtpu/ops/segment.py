"""Segment reductions: `segment_reduce` and its backward, with ATen's CPU semantics.

`data` is reduced along `axis` in runs of consecutive positions (segments) given by `lengths`
or `offsets`, whose last dimension is `axis` and whose leading dimensions index `data`'s: each
row of them segments one row of `data`. A segment starts from `initial` (default: the
reduction's identity, -inf for max); `mean` divides by the length, and an empty segment's mean
is NaN without `initial`. `max`/`min` propagate NaN. Positions in no segment (unsafe lengths
summing to less than the axis, offsets not starting at 0) are ignored, as on CPU.

Every position is mapped to its segment (a search in the segments' ends), then one scatter
reduces into (rows, segments + 1, inner); the extra segment collects the positions of none.
Segment bounds are values: ATen's checks of them (non-negative lengths, lengths summing to the
axis unless `unsafe`) are device-side checks, raised at the next synchronisation. Segments
reaching past the data are rejected too (the CPU kernel would read beyond its buffer).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten

# ATen's reduction names (get_reduction_enum): amax/amin are max/min.
_REDUCTIONS = {"sum": "sum", "mean": "mean", "prod": "prod", "max": "max", "amax": "max", "min": "min",
               "amin": "min"}
_IDENTITY = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": -math.inf, "min": math.inf}
_INDEX_DTYPES = (torch.int32, torch.int64)
_DATA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _wrap(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def _validate(data, reduce: str, lengths=None, offsets=None, axis: int = 0) -> None:
    """ATen's CPU-kernel checks of the arguments' kinds (its meta kernel checks none of them)."""
    if reduce not in _REDUCTIONS:
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    bounds = offsets if offsets is not None else lengths
    if bounds is None:
        raise RuntimeError("segment_reduce(): Either lengths or offsets must be defined.")
    name = "offsets" if offsets is not None else "lengths"
    if data.dim() < bounds.dim():
        raise RuntimeError(f"segment_reduce(): data has {data.dim()} dimensions, fewer than {name} ({bounds.dim()})")
    if _wrap(axis, data.dim()) != bounds.dim() - 1:
        raise RuntimeError(f"segment_reduce(): Expected axis to be the last dimension of {name} but got {axis}.")
    if bounds.dtype not in _INDEX_DTYPES:
        raise NotImplementedError(f'"_segment_reduce_{name}_cpu_kernel1" not implemented for {bounds.dtype}')
    if data.dtype not in _DATA_DTYPES:
        raise NotImplementedError(f'"_segment_reduce_cpu" not implemented for {data.dtype}')


def _meta(data, reduce: str, *, lengths=None, indices=None, offsets=None, axis: int = 0, unsafe: bool = False,
          initial=None):
    """The CPU kernel's argument checks, then PyTorch's meta kernel with `axis` wrapped as the
    CPU kernel wraps it (the meta kernel indexes `lengths.shape` with the unwrapped axis)."""
    if indices is not None:
        raise RuntimeError("segment_reduce(): indices based reduction is not supported yet.")
    _validate(data, reduce, lengths=lengths, offsets=offsets, axis=axis)
    return aten.segment_reduce.default(data, reduce, lengths=lengths, indices=indices, offsets=offsets,
                                       axis=_wrap(axis, data.dim()), unsafe=unsafe, initial=initial)


class _Segments(NamedTuple):
    """Where each position of `data` (viewed as (rows, size, inner)) goes."""

    rows: int
    count: int  # segments per row
    ids: jax.Array  # (rows, size): the position's segment, `count` if none
    lengths: jax.Array  # (rows, count)
    last: jax.Array  # (rows, size): the position is the last of its segment


def _segments(ctx, shape: tuple[int, ...], axis: int, lengths, offsets, unsafe: bool) -> _Segments:
    rows, size = math.prod(shape[:axis]), shape[axis]
    if offsets is not None:
        bounds = offsets.reshape(rows, -1).astype(np.int64)
        starts, ends = bounds[:, :-1], bounds[:, 1:]
        seg_lengths = ends - starts
        ctx.check(seg_lengths >= 0, "offsets must be non-decreasing (a segment has a negative length)")
        ctx.check((bounds[:, 0] >= 0) & (bounds[:, -1] <= size),
                  f"offsets must lie in [0, {size}], the size of data along axis {axis}")
    else:
        seg_lengths = lengths.reshape(rows, -1).astype(np.int64)
        ends = jnp.cumsum(seg_lengths, -1)
        starts = ends - seg_lengths
        ctx.check(seg_lengths >= 0, "lengths contains negative value!")
        total = ends[:, -1] if ends.shape[-1] else jnp.zeros(rows, np.int64)
        if unsafe:
            ctx.check(total <= size, f"lengths sum to more than {size}, the size of data along axis {axis}")
        else:
            ctx.check(total == size, "segment_reduce(): Expected all rows of lengths along axis to sum to "
                                     "data.size(lengths.dim()-1) when !unsafe.")
    count = seg_lengths.shape[-1]
    position = jnp.arange(size, dtype=np.int64)
    ids = jax.vmap(lambda row_ends: jnp.searchsorted(row_ends, position, side="right"))(ends)
    in_segment = ids < count
    clamped = jnp.minimum(ids, max(count - 1, 0))
    if count:
        row_starts = jnp.take_along_axis(starts, clamped, 1)
        row_ends = jnp.take_along_axis(ends, clamped, 1)
    else:
        row_starts = row_ends = jnp.zeros((rows, size), np.int64)
    in_segment = in_segment & (position >= row_starts)
    ids = jnp.where(in_segment, ids, count)
    return _Segments(rows, count, ids, seg_lengths, in_segment & (position == row_ends - 1))


def _by_segment(values, segments: _Segments, start, combine: str):
    """Scatter `values` (rows, size, inner) into (rows, count, inner) starting from `start`."""
    rows = jnp.arange(segments.rows)[:, None]
    target = jnp.full((segments.rows, segments.count + 1, values.shape[-1]), start, values.dtype)
    return getattr(target.at[rows, segments.ids], combine)(values)[:, :segments.count]


def _per_position(values, segments: _Segments):
    """Each position's entry of `values` (rows, count, inner) (anything for no segment)."""
    if segments.count == 0:
        return jnp.zeros((segments.rows, segments.ids.shape[1], values.shape[-1]), values.dtype)
    index = jnp.minimum(segments.ids, segments.count - 1)[..., None]
    return jnp.take_along_axis(values, index, 1)


def _initial(initial, reduction: str, data_dtype, compute):
    """The segments' starting value: `initial` rounded to the data dtype (as the CPU kernel
    converts it), else the reduction's identity."""
    value = _IDENTITY[reduction] if initial is None else initial
    return jnp.asarray(value, data_dtype).astype(compute)


def _reduce(data, segments: _Segments, reduction: str, start):
    """(rows, count, inner) segment results of `data` (rows, size, inner)."""
    if reduction in ("sum", "mean"):
        out = _by_segment(data, segments, start, "add")
    elif reduction == "prod":
        out = _by_segment(data, segments, start, "multiply")
    else:
        out = _by_segment(data, segments, start, reduction)
        # ATen's max/min propagate NaN (scatter max/min need not).
        nans = _by_segment(jnp.isnan(data).astype(np.int32), segments, jnp.isnan(start).astype(np.int32), "max")
        out = jnp.where(nans > 0, jnp.asarray(jnp.nan, out.dtype), out)
    return out


@registry.register(aten.segment_reduce.default, meta=_meta)
def segment_reduce(ctx, data, reduce: str, *, lengths=None, indices=None, offsets=None, axis: int = 0,
                   unsafe: bool = False, initial=None):
    axis = _wrap(axis, data.ndim)
    reduction = _REDUCTIONS[reduce]
    compute = opmath(data.dtype)
    segments = _segments(ctx, data.shape, axis, lengths, offsets, unsafe)
    values = data.astype(compute).reshape(segments.rows, data.shape[axis], -1)
    start = _initial(initial, reduction, data.dtype, compute)
    out = _reduce(values, segments, reduction, start)
    if reduction == "mean":
        count = segments.lengths[..., None].astype(compute)
        empty = jnp.asarray(jnp.nan if initial is None else start, compute)
        out = jnp.where(count > 0, out / jnp.maximum(count, 1), empty)
    return out.reshape(ctx.out_shape())


def _exclusive_products(values, segments: _Segments, start):
    """For every position, `start` times the product of the other values of its segment: a
    segmented product scan from each side (first and last positions reset it)."""
    first = segments.ids != jnp.pad(segments.ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]

    def scan(x, resets, reverse: bool):
        def combine(a, b):
            (va, ra), (vb, rb) = a, b
            return jnp.where(rb, vb, va * vb), ra | rb

        flags = jnp.broadcast_to(resets[..., None], x.shape)
        return lax.associative_scan(combine, (x, flags), reverse=reverse, axis=1)[0]

    ones = jnp.ones_like(values[:, :1])
    before = jnp.where(first[..., None], 1, jnp.concatenate([ones, scan(values, first, False)[:, :-1]], 1))
    last = segments.last | (segments.ids == segments.count)
    after = jnp.where(last[..., None], 1, jnp.concatenate([scan(values, last, True)[:, 1:], ones], 1))
    return start * before * after


@registry.register(aten._segment_reduce_backward.default)
def segment_reduce_backward(ctx, grad, output, data, reduce: str, *, lengths=None, offsets=None,
                            axis: int = 0, initial=None):
    """The gradient w.r.t. `data`, as ATen's CPU kernel computes it: max/min send the gradient to
    every position equal to the result (or NaN) and, when several are, divide the positive
    gradients among them; prod divides `grad * output` by the value, or multiplies `grad` by the
    product of the others where the value is 0 or NaN."""
    axis = _wrap(axis, data.ndim)
    reduction = _REDUCTIONS[reduce]
    compute = opmath(data.dtype)
    segments = _segments(ctx, data.shape, axis, lengths, offsets, unsafe=True)
    values = data.astype(compute).reshape(segments.rows, data.shape[axis], -1)
    as_segments = lambda t: t.astype(compute).reshape(segments.rows, segments.count, -1)  # noqa: E731
    g = _per_position(as_segments(grad), segments)
    if reduction == "sum":
        result = g
    elif reduction == "mean":
        result = g / _per_position(as_segments(segments.lengths), segments)
    elif reduction == "prod":
        out = _per_position(as_segments(output), segments)
        start = _initial(initial, reduction, data.dtype, compute)
        exclusive = _exclusive_products(values, segments, start)
        result = jnp.where(jnp.isnan(values) | (values == 0), g * exclusive, g * out / values)
    else:
        hit = jnp.isnan(values) | (values == _per_position(as_segments(output), segments))
        ties = _per_position(_by_segment(hit.astype(compute), segments, 0, "add"), segments)
        result = jnp.where(hit, jnp.where((ties >= 2) & (g > 0), g / ties, g), 0)
    in_segment = (segments.ids < segments.count)[..., None]
    return jnp.where(in_segment, result, 0).reshape(data.shape)
