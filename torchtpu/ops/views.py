"""Functional lowerings of PyTorch's view ops: each returns the view's value as a new array.

In eager mode a view op runs no program: PyTorch's own kernels set sizes, strides and storage
offset on a tensor that shares its base's storage (`torchtpu.exec.kernels`). Compiled graphs,
the deferred executor and functionalization use views as functions of values instead; those
calls land here, mostly through the `*_copy` overloads functionalization emits, which share each
body with their view.

`transpose_view` gives every view its adjoint -- the view's value placed back where the view
reads it -- from which the `*_scatter` ops and the views' backward ops are built (`shape.py`),
so no view's index arithmetic is written twice.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu import strided
from torchtpu.ops import registry

aten = torch.ops.aten


def canonical_dim(dim: int, ndim: int) -> int:
    """`dim` in [0, ndim) (PyTorch treats a 0-dim tensor as having one dim to wrap against)."""
    return dim % max(ndim, 1)


# --- bodies: plain functions of values, shared by the views, their copies and their adjoints ----


def select(x, dim: int, index: int):
    dim = canonical_dim(dim, x.ndim)
    return lax.index_in_dim(x, index % x.shape[dim], axis=dim, keepdims=False)


def slice_bounds(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    """PyTorch's clamping of slice bounds: negative bounds count from the end, then both are
    clamped to [0, size] and `end` to at least `start`."""
    start = 0 if start is None else start
    end = size if end is None else end
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    return start, end


def slice_dim(x, dim: int, start: int | None, end: int | None, step: int):
    dim = canonical_dim(dim, x.ndim)
    begin, stop = slice_bounds(x.shape[dim], start, end)
    return lax.slice_in_dim(x, begin, stop, step, axis=dim)


def diagonal(x, offset: int, dim1: int, dim2: int):
    return jnp.diagonal(x, offset, canonical_dim(dim1, x.ndim), canonical_dim(dim2, x.ndim))


def unfold(x, dim: int, size: int, step: int):
    """Windows of `size` every `step` along `dim`; the window index replaces `dim`, the position
    within the window becomes the last dim."""
    if x.ndim == 0:
        return x.reshape(1)
    dim = canonical_dim(dim, x.ndim)
    count = (x.shape[dim] - size) // step + 1
    windows = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    return jnp.moveaxis(jnp.take(x, windows, axis=dim), dim + 1, -1)


def split_with_sizes(x, sizes: Sequence[int], dim: int) -> list:
    dim = canonical_dim(dim, x.ndim)
    bounds = np.cumsum((0, *sizes))
    return [lax.slice_in_dim(x, int(a), int(b), axis=dim) for a, b in zip(bounds[:-1], bounds[1:])]


def memory_run(x, meta: torch.Tensor):
    """`x`'s elements in storage order, as a flat array starting at `meta.storage_offset()`.

    Only a dense tensor (a permutation of a contiguous block, no gaps or overlaps) holds its
    whole run of storage in its value; for any other tensor that run is not a function of the
    value, and a ValueError says so.
    """
    order = sorted(range(x.ndim), key=lambda d: -meta.stride(d))
    expected = 1
    for d in reversed(order):
        if meta.size(d) != 1 and meta.stride(d) != expected:
            raise ValueError(
                f"as_strided over a value needs a dense input; got sizes {tuple(meta.shape)} with "
                f"strides {tuple(meta.stride())}, whose storage has gaps or overlaps"
            )
        expected *= meta.size(d)
    return jnp.transpose(x, order).reshape(-1)


def as_strided(x, meta: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None):
    """`as_strided` as a function of `x`'s value: the geometry addresses `x`'s own storage run."""
    flat = memory_run(x, meta)
    base = meta.storage_offset()
    offset = base if storage_offset is None else storage_offset
    geometry = strided.Geometry(tuple(size), tuple(stride), offset - base)
    if geometry.numel:
        lowest = geometry.offset + sum(min(0, (n - 1) * s) for n, s in zip(size, stride))
        highest = geometry.offset + sum(max(0, (n - 1) * s) for n, s in zip(size, stride))
        if lowest < 0 or highest >= flat.shape[0]:
            raise ValueError(
                f"as_strided(size={tuple(size)}, stride={tuple(stride)}, storage_offset={offset}) "
                f"reads storage elements [{lowest + base}, {highest + base}], outside the input's "
                f"[{base}, {base + flat.shape[0]})"
            )
    return strided.read(flat, geometry)


def transpose_view(view: Callable, shape: Sequence[int], dtype, value):
    """The adjoint of the linear map `view` from arrays of `shape`: `value` placed where `view`
    reads it, zeros elsewhere, overlapping reads summed. A slice's adjoint is a pad, a gather's
    a scatter-add; bool values go through uint8 (linear maps need numbers)."""
    dtype = np.dtype(dtype)
    work = np.dtype(np.uint8) if dtype == np.bool_ else dtype
    adjoint = jax.linear_transpose(view, jax.ShapeDtypeStruct(tuple(shape), work))
    (out,) = adjoint(jnp.asarray(value, work))
    return out.astype(dtype)


def scatter_into_view(view: Callable, x, src):
    """`x` with the elements `view` reads replaced by `src` (the `*_scatter` ops)."""
    src = jnp.broadcast_to(jnp.asarray(src, x.dtype), jax.eval_shape(view, x).shape)
    placed = transpose_view(view, x.shape, x.dtype, src)
    covered = transpose_view(view, x.shape, np.uint8, jnp.ones(src.shape, np.uint8))
    return jnp.where(covered != 0, placed, x)


# --- registrations --------------------------------------------------------------------------------
# Views and their `*_copy` forms share one body. A view's lowering is what compiled graphs and
# decompositions use; in eager mode a view only changes metadata (`kernels._returns_alias`).


@registry.register(
    aten.view.default,
    aten.view_copy.default,
    aten._reshape_alias.default,
    aten._reshape_alias_copy.default,
    aten._unsafe_view.default,
    aten.squeeze_copy.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
    aten.unsqueeze_copy.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
)
def reshape(ctx, x, *shape_args):
    return x.reshape(ctx.out_shape())


@registry.register(
    aten.alias.default, aten.alias_copy.default, aten.detach.default, aten.detach_copy.default,
    aten.lift_fresh_copy.default,
)
def identity(ctx, x):
    return x


@registry.register(aten.view_copy.dtype)
def view_dtype(ctx, x, dtype):
    """Reinterpret the bytes of the last dim (`Tensor.view(dtype)`)."""
    return strided.bitcast(x, ctx.out_dtype()).reshape(ctx.out_shape())


@registry.register(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real(ctx, x):
    """A complex tensor's (real, imaginary) pairs as a last dim of 2 floats."""
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@registry.register(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def view_as_complex(ctx, x):
    """A last dim of 2 floats as complex numbers."""
    return lax.complex(x[..., 0], x[..., 1])


@registry.register(aten.permute.default, aten.permute_copy.default)
def permute(ctx, x, dims):
    return jnp.transpose(x, [canonical_dim(d, x.ndim) for d in dims])


@registry.register(aten.transpose.int, aten.transpose_copy.int)
def transpose(ctx, x, dim0, dim1):
    if x.ndim == 0:
        return x
    return jnp.swapaxes(x, canonical_dim(dim0, x.ndim), canonical_dim(dim1, x.ndim))


@registry.register(aten.t.default, aten.t_copy.default)
def t(ctx, x):
    return x.T


@registry.register(aten.expand.default, aten.expand_copy.default)
def expand(ctx, x, size, implicit=False):
    return jnp.broadcast_to(x, ctx.out_shape())


@registry.register(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(ctx, x, dim=0, start=None, end=None, step=1):
    return slice_dim(x, dim, start, end, step)


@registry.register(aten.select.int, aten.select_copy.int)
def select_(ctx, x, dim, index):
    return select(x, dim, index)


@registry.register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_(ctx, x, offset=0, dim1=0, dim2=1):
    return diagonal(x, offset, dim1, dim2)


@registry.register(aten.unfold.default, aten.unfold_copy.default)
def unfold_(ctx, x, dimension, size, step):
    return unfold(x, dimension, size, step)


@registry.register(aten.as_strided.default)
def as_strided_(ctx, x, size, stride, storage_offset=None):
    return as_strided(x, ctx.arg("self"), size, stride, storage_offset)


@registry.register(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def split_with_sizes_(ctx, x, split_sizes, dim=0):
    return split_with_sizes(x, split_sizes, dim)


@registry.register(aten.split.Tensor, aten.split_copy.Tensor)
def split(ctx, x, split_size, dim=0):
    dim = canonical_dim(dim, x.ndim)
    return split_with_sizes(x, [part.shape[dim] for part in ctx.meta_out], dim)


@registry.register(aten.unbind.int, aten.unbind_copy.int)
def unbind(ctx, x, dim=0):
    dim = canonical_dim(dim, x.ndim)
    return [select(x, dim, i) for i in range(x.shape[dim])]
