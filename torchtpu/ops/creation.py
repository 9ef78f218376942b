"""Factory ops: arange (and the deprecated range), full (and the zeros of `_efficientzerotensor`),
empty in compiled graphs, eye, linspace, logspace, tril/triu indices (device given by argument).

The output shape and dtype come from PyTorch's meta kernels (`ctx.out_shape()`,
`ctx.out_dtype()`), which also do the dtype inference from Scalar types and the argument
checks. The values follow ATen's CPU kernels, including the dtype in which they are computed:
`arange` in the accumulate type (float64 for float32, int64 for integers, with Scalars converted
to it first), `linspace` in the output dtype (float64 steps for integer outputs). Fill values are
runtime inputs (`dynamic_scalars`): a new value does not recompile.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


def _integral(dtype) -> bool:
    return not jnp.issubdtype(dtype, jnp.inexact)


def _arange_meta(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`arange`'s output as ATen's CPU kernel sizes it. For integer dtypes narrower than int64
    the size comes from the float64 range, and a fractional step that truncates to 0 is allowed
    (every element is `start`); PyTorch's meta kernel rejects that step."""
    if dtype in (torch.int8, torch.int16, torch.int32, torch.uint8) and step != 0 and int(step) == 0:
        size = math.ceil((float(end) - float(start)) / float(step))
        if size < 0:
            raise RuntimeError("upper bound and lower bound inconsistent with step sign")
        return torch.empty(size, dtype=dtype, device="meta")
    return aten.arange.start_step(start, end, step, dtype=dtype, layout=layout, device=device,
                                  pin_memory=pin_memory)


@registry.register(aten.arange.start_step, meta=_arange_meta)
def arange(ctx, start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    out = ctx.out_dtype()
    if _integral(out):
        accumulate, start, step = np.dtype(np.int64), int(start), int(step)
    else:
        accumulate = np.dtype(np.float64) if np.dtype(out).itemsize >= 4 else np.dtype(np.float32)
    (n,) = ctx.out_shape()
    return jnp.asarray(start, accumulate) + jnp.asarray(step, accumulate) * jnp.arange(n, dtype=accumulate)


@registry.register(aten.range.step, aten.range.default)
def range_(ctx, start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`torch.range` (deprecated by PyTorch: `end` is included): `arange`'s values over the size
    PyTorch's meta kernel gives it."""
    return arange(ctx, start, end, step)


@registry.register(aten.full.default, dynamic_scalars=True)
def full(ctx, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(ctx.out_shape(), fill_value, ctx.out_dtype())


@registry.register(aten.full_like.default, dynamic_scalars=True)
def full_like(ctx, x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(ctx.out_shape(), fill_value, ctx.out_dtype())


@registry.register(aten.empty.memory_format, aten.empty_strided.default, aten.empty_permuted.default)
def empty(ctx, *args, **kwargs):
    """`torch.empty` and its strided forms inside compiled graphs (AOTAutograd writes `empty_like`
    as `empty_permuted`): the values are undefined, so zeros; the executor lays the result out by
    the meta kernel's strides. Eager calls keep their factory kernels, which make a storage
    without a buffer (`exec.memory`)."""
    return jnp.zeros(ctx.out_shape(), ctx.out_dtype())


@registry.register(aten._efficientzerotensor.default)
def efficient_zero_tensor(ctx, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """The zeros autograd uses for a gradient known to be zero (complex `sgn`'s at 0, say): on
    CPU a storage-less ZeroTensor; here plain zeros, which every op reads correctly."""
    return jnp.zeros(ctx.out_shape(), ctx.out_dtype())


@registry.register(aten.scalar_tensor.default, dynamic_scalars=True)
def scalar_tensor(ctx, s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s).astype(ctx.out_dtype()).reshape(())


@registry.register(aten.eye.default, aten.eye.m)
def eye(ctx, n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None):
    rows, columns = ctx.out_shape()
    return jnp.eye(rows, columns, dtype=ctx.out_dtype())


def linspace_values(start, end, steps: int, dtype):
    """`steps` points from `start` to `end` as ATen computes them: the first half counts up from
    `start`, the second half down from `end` (so both ends are exact), in `dtype` for floating
    outputs and in float64 for integer outputs (whose Scalars are truncated to integers first)."""
    if _integral(dtype):
        compute = np.dtype(np.float64)
        start, end = float(int(start)), float(int(end))
    else:
        compute = np.dtype(dtype)
    if steps == 1:
        return jnp.full((1,), start, compute)
    start, end = jnp.asarray(start, compute), jnp.asarray(end, compute)
    step = (end - start) / jnp.asarray(steps - 1, compute)
    index = jnp.arange(steps, dtype=np.int64)
    up = start + step * index.astype(compute)
    down = end - step * (steps - index - 1).astype(compute)
    return jnp.where(index < steps // 2, up, down)


@registry.register(aten.linspace.default)
def linspace(ctx, start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    return linspace_values(start, end, steps, ctx.out_dtype())


@registry.register(aten.logspace.default)
def logspace(ctx, start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    """base ** linspace(start, end): for floating outputs, start and end rounded to the output
    dtype, then exponents and powers in opmath (float32 for bfloat16, unlike linspace itself);
    for integer outputs, in float64. One step is base ** start in float64, unrounded."""
    out = ctx.out_dtype()
    if steps == 1:  # ATen fills base ** start, computed in float64
        return jnp.full((1,), np.power(np.float64(base), np.float64(start))).astype(out)
    if _integral(out):
        compute = np.dtype(np.float64)
        exponents = linspace_values(start, end, steps, out)
    else:
        compute = opmath(out)
        start, end = (float(np.asarray(v, out)) for v in (start, end))  # ATen rounds them first
        exponents = linspace_values(start, end, steps, compute)
    return jnp.power(jnp.asarray(base, compute), exponents)


def _triangle_indices(ctx, mask):
    """The (2, N) coordinates of `mask`'s True entries in row-major order."""
    (_, n) = ctx.out_shape()
    rows, columns = jnp.nonzero(mask, size=n)
    return jnp.stack([rows, columns]).astype(ctx.out_dtype())


@registry.register(aten.tril_indices.default)
def tril_indices(ctx, row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _triangle_indices(ctx, jnp.tri(row, col, offset, dtype=bool))


@registry.register(aten.triu_indices.default)
def triu_indices(ctx, row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _triangle_indices(ctx, ~jnp.tri(row, col, offset - 1, dtype=bool))
