"""Pooling: max (with indices), average, adaptive and fractional pools, and their backward ops.

Every pool here is separable. Along each spatial dimension a window table says which input
positions feed each output position (`Windows`: source index and validity, shape (out, length);
fractional pools have one table per plane). A pool reduces the spatial dimensions one at a time,
last first, gathering each window's candidates and reducing them:

- averages sum the valid candidates and divide once by the window sizes PyTorch uses;
- maxima pick PyTorch's winner -- the first maximum in row-major window order, or the last NaN --
  and carry its flat index within the plane (`h * W + w`); taking the last dimension first makes
  per-dimension choices compose into exactly that row-major rule.

Max-type backward ops add the output gradient at the saved indices; average pools are linear,
so their backward ops are the transpose (`jax.vjp`) of the forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


class Windows(NamedTuple):
    """Input positions of each output position's window along one dimension."""

    index: jax.Array | np.ndarray  # (out, length), or (*batch, out, length) per plane; int
    valid: np.ndarray | None  # (out, length) bool, None when every candidate is valid


def _dims(values: Sequence[int], n: int) -> tuple[int, ...]:
    """ATen's int[n] arguments may hold one value for every dimension."""
    values = tuple(values)
    return values * n if len(values) == 1 else values


def _regular(size: int, out: int, kernel: int, stride: int, pad: int, dilation: int) -> Windows:
    start = np.arange(out)[:, None] * stride - pad + np.arange(kernel)[None, :] * dilation
    valid = (start >= 0) & (start < size)
    return Windows(np.clip(start, 0, size - 1), None if valid.all() else valid)


def _adaptive(size: int, out: int) -> tuple[Windows, np.ndarray]:
    """Windows [floor(i * size / out), ceil((i + 1) * size / out)) and their lengths."""
    o = np.arange(out)
    start = (o * size) // out
    end = -((-(o + 1) * size) // out)
    length = int((end - start).max()) if out else 0
    index = start[:, None] + np.arange(length)[None, :]
    valid = index < end[:, None]
    return Windows(np.minimum(index, size - 1), valid), end - start


def _table(windows: Windows, ndim: int):
    """The window index table shaped to broadcast against candidates of rank `ndim`,
    (..., out, length): per-plane tables get size-1 axes for the spatial dims in between."""
    index = windows.index
    if index.ndim == 2:
        return index
    batch = index.shape[:-2]
    return index.reshape(batch + (1,) * (ndim - index.ndim) + index.shape[-2:])


def _gather(x, axis: int, windows: Windows):
    """x with `axis` replaced by (out, length) candidates, moved last: (..., out, length)."""
    x = jnp.moveaxis(x, axis, -1)
    if isinstance(windows.index, np.ndarray):
        return x[..., windows.index]
    index = _table(windows, x.ndim + 1)
    out, length = index.shape[-2:]
    index = jnp.broadcast_to(index, x.shape[:-1] + (out, length))
    return jnp.take_along_axis(x, index.reshape(x.shape[:-1] + (out * length,)), -1).reshape(
        index.shape
    )


def _window_sum(x, spatial_axes: Sequence[int], tables: Sequence[Windows]):
    """Sum of each window's valid candidates, one dimension at a time."""
    for axis, windows in zip(spatial_axes, tables):
        candidates = _gather(x, axis, windows)
        if windows.valid is not None:
            candidates = jnp.where(windows.valid, candidates, jnp.zeros((), x.dtype))
        x = jnp.moveaxis(jnp.sum(candidates, -1), -1, axis)
    return x


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _pick(values, positions, valid):
    """PyTorch's max-pool winner along the last axis: the last NaN if any, else the first
    valid maximum. Returns (value, position) of the winner."""
    if valid is not None:
        values = jnp.where(valid, values, _lowest(values.dtype))
    best = jnp.max(values, -1, keepdims=True)
    hit = values == best
    if valid is not None:
        hit = hit & valid
    first_max = jnp.argmax(hit, -1)
    if jnp.issubdtype(values.dtype, jnp.floating):
        nan = jnp.isnan(values)
        last_nan = nan.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], -1)
        first_max = jnp.where(jnp.any(nan, -1), last_nan, first_max)
    choice = first_max[..., None]
    return (jnp.take_along_axis(values, choice, -1)[..., 0],
            jnp.take_along_axis(positions, choice, -1)[..., 0])


def _window_max(x, tables: Sequence[Windows]):
    """(max, flat index within the plane) over separable windows of the last len(tables) dims."""
    n = len(tables)
    sizes = x.shape[x.ndim - n:]
    flat = jnp.zeros(x.shape, np.int64)
    for d in reversed(range(n)):
        axis = x.ndim - n + d
        windows = tables[d]
        values = _gather(x, axis, windows)
        carried = _gather(flat, axis, windows)
        position = _table(windows, values.ndim).astype(np.int64) * math.prod(sizes[d + 1:])
        position = position + carried
        x, flat = _pick(values, position, windows.valid)
        x, flat = jnp.moveaxis(x, -1, axis), jnp.moveaxis(flat, -1, axis)
    return x, flat


def _scatter_to_planes(grad, indices, shape: tuple[int, ...], n: int):
    """Add `grad` into zeros of `shape` at flat plane indices (the backward of max pools)."""
    planes = math.prod(shape[: len(shape) - n])
    plane_size = math.prod(shape[len(shape) - n:])
    grad = grad.reshape(planes, -1)
    rows = jnp.arange(planes)[:, None]
    out = jnp.zeros((planes, plane_size), grad.dtype).at[rows, indices.reshape(planes, -1)].add(grad)
    return out.reshape(shape)


def _spatial(ctx, n: int, index: int = 0) -> tuple[int, ...]:
    return ctx.out_shape(index)[-n:]


# --- max pooling ------------------------------------------------------------------------------


def _max_pool(ctx, x, n, kernel_size, stride, padding, dilation):
    kernel = _dims(kernel_size, n)
    stride = _dims(stride, n) if stride else kernel
    padding, dilation = _dims(padding, n), _dims(dilation, n)
    tables = [
        _regular(size, out, k, s, p, d)
        for size, out, k, s, p, d in zip(x.shape[-n:], _spatial(ctx, n), kernel, stride, padding,
                                         dilation)
    ]
    return _window_max(x, tables)


@registry.register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(ctx, x, kernel_size, stride=(), padding=(0,), dilation=(1,),
                            ceil_mode=False):
    return _max_pool(ctx, x, 2, kernel_size, stride, padding, dilation)


@registry.register(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(ctx, x, kernel_size, stride=(), padding=(0,), dilation=(1,),
                            ceil_mode=False):
    return _max_pool(ctx, x, 3, kernel_size, stride, padding, dilation)


@registry.register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(ctx, grad, x, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    return _scatter_to_planes(grad, indices, x.shape, 2)


@registry.register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(ctx, grad, x, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    return _scatter_to_planes(grad, indices, x.shape, 3)


@registry.register(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(ctx, x, output_size):
    n = len(output_size)
    tables = [_adaptive(size, out)[0] for size, out in zip(x.shape[-n:], _spatial(ctx, n))]
    return _window_max(x, tables)


@registry.register(aten.adaptive_max_pool2d_backward.default,
                   aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool_backward(ctx, grad, x, indices):
    n = 2 if ctx.op is aten.adaptive_max_pool2d_backward.default else 3
    return _scatter_to_planes(grad, indices, x.shape, n)


def _fractional_windows(samples, size: int, out: int, kernel: int, dtype) -> Windows:
    """Per-plane windows of a fractional max pool from its uniform samples (*batch,):
    start_i = int((i + u) * alpha) - int(u * alpha), alpha = (size - kernel) / (out - 1),
    and the last window ends at the input's end."""
    u = samples.astype(dtype)[..., None]
    if out > 1:
        alpha = jnp.asarray((size - kernel) / (out - 1), dtype)
        i = jnp.arange(out, dtype=dtype)
        start = ((i + u) * alpha).astype(np.int64) - (u * alpha).astype(np.int64)
        start = start.at[..., -1].set(size - kernel)
    else:
        start = jnp.full(u.shape[:-1] + (out,), size - kernel, np.int64)
    return Windows(start[..., None] + jnp.arange(kernel), None)


def _fractional_max_pool(ctx, x, kernel_size, output_size, samples):
    n = len(output_size)
    kernel = _dims(kernel_size, n)
    # PyTorch's sample order per plane: 2d (w, h), 3d (t, h, w).
    order = (1, 0) if n == 2 else (0, 1, 2)
    compute = opmath(x.dtype)
    batched = x.ndim == n + 2
    planes = samples if batched else samples[0]
    tables = [
        _fractional_windows(planes[..., order[d]], x.shape[x.ndim - n + d], output_size[d],
                            kernel[d], compute)
        for d in range(n)
    ]
    return _window_max(x, tables)


@registry.register(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def fractional_max_pool(ctx, x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(ctx, x, kernel_size, output_size, random_samples)


@registry.register(aten.fractional_max_pool2d_backward.default,
                   aten.fractional_max_pool3d_backward.default)
def fractional_max_pool_backward(ctx, grad, x, kernel_size, output_size, indices):
    return _scatter_to_planes(grad, indices, x.shape, len(output_size))


# --- average pooling --------------------------------------------------------------------------


def _avg_divisor(size, out, kernel, stride, pad, count_include_pad):
    """Per output position along one dim: the window length PyTorch divides by."""
    start = np.arange(out) * stride - pad
    end = np.minimum(start + kernel, size + pad)
    if count_include_pad:
        return end - start
    return np.minimum(end, size) - np.maximum(start, 0)


def _avg_pool(x, outs, kernel_size, stride, padding, count_include_pad, divisor_override):
    n = len(outs)
    kernel = _dims(kernel_size, n)
    stride = _dims(stride, n) if stride else kernel
    padding = _dims(padding, n)
    sizes = x.shape[-n:]
    tables = [_regular(*args, 1) for args in zip(sizes, outs, kernel, stride, padding)]
    total = _window_sum(x, range(x.ndim - n, x.ndim), tables)
    if divisor_override:
        return total / divisor_override
    divisor = np.ones((), np.int64)
    for args in zip(sizes, outs, kernel, stride, padding):
        divisor = np.multiply.outer(divisor, _avg_divisor(*args, count_include_pad))
    return total / divisor.astype(total.dtype)


def _transpose(forward, x, grad):
    """The backward of a pool linear in its input: vjp of `forward` at `x`."""
    compute = opmath(x.dtype)
    _, vjp = jax.vjp(forward, x.astype(compute))
    return vjp(grad.astype(compute))[0]


@registry.register(aten.avg_pool2d.default, aten.avg_pool3d.default)
def avg_pool(ctx, x, kernel_size, stride=(), padding=(0,), ceil_mode=False,
             count_include_pad=True, divisor_override=None):
    n = 2 if ctx.op is aten.avg_pool2d.default else 3
    x = x.astype(opmath(x.dtype))
    return _avg_pool(x, _spatial(ctx, n), kernel_size, stride, padding, count_include_pad,
                     divisor_override)


@registry.register(aten.avg_pool1d.default)
def avg_pool1d(ctx, x, kernel_size, stride=(), padding=(0,), ceil_mode=False,
               count_include_pad=True):
    x = x.astype(opmath(x.dtype))
    return _avg_pool(x, _spatial(ctx, 1), kernel_size, stride, padding, count_include_pad, None)


@registry.register(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def avg_pool_backward(ctx, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                      divisor_override):
    n = 2 if ctx.op is aten.avg_pool2d_backward.default else 3

    def forward(v):
        return _avg_pool(v, grad.shape[-n:], kernel_size, stride, padding, count_include_pad,
                         divisor_override)

    return _transpose(forward, x, grad)


def _adaptive_avg(x, output_size: Sequence[int]):
    n = len(output_size)
    tables, lengths = zip(*(_adaptive(size, out) for size, out in zip(x.shape[-n:], output_size)))
    total = _window_sum(x, range(x.ndim - n, x.ndim), tables)
    divisor = np.ones((), np.int64)
    for length in lengths:
        divisor = np.multiply.outer(divisor, length)
    return total / divisor.astype(total.dtype)


@registry.register(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default,
                   aten.adaptive_avg_pool1d.default)
def adaptive_avg_pool(ctx, x, output_size):
    return _adaptive_avg(x.astype(opmath(x.dtype)), _spatial(ctx, len(output_size)))


@registry.register(aten._adaptive_avg_pool2d_backward.default,
                   aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool_backward(ctx, grad, x):
    n = 2 if ctx.op is aten._adaptive_avg_pool2d_backward.default else 3
    return _transpose(lambda v: _adaptive_avg(v, grad.shape[-n:]), x, grad)
