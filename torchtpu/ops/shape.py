"""Shape ops that make new tensors: concatenation, padding, flips and rolls, repeats, triangles,
diagonal embedding, the `*_scatter` ops and the backward ops of views.

The `*_scatter` ops and the backward ops of views and paddings are adjoints of the forward
bodies (`views.transpose_view`): each op's index arithmetic is written once, and XLA sees the
transpose of a slice as a pad and of a gather as a scatter-add.
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops import registry, views
from torchtpu.ops.views import canonical_dim

aten = torch.ops.aten


@registry.register(aten.clone.default)
def clone(ctx, x, *, memory_format=None):
    return x


@registry.register(aten.cat.default)
def cat(ctx, tensors, dim=0):
    """Concatenation in the promoted dtype. 1-D empty tensors are skipped whatever their rank
    (PyTorch's legacy rule, checked by its meta kernel)."""
    dtype = ctx.out_dtype()
    parts = [t.astype(dtype) for t in tensors if t.shape != (0,)]
    if not parts:
        return jnp.zeros(ctx.out_shape(), dtype)
    return jnp.concatenate(parts, axis=canonical_dim(dim, len(ctx.out_shape())))


# --- padding ---------------------------------------------------------------------------------------


def _pairs(ndim: int, pad) -> list[tuple[int, int]]:
    """PyTorch's flat padding list (last dim first) as one (before, after) pair per dim."""
    pairs = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        pairs[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


@registry.register(aten.constant_pad_nd.default, dynamic_scalars=True)
def constant_pad_nd(ctx, x, pad, value=0):
    """Negative padding crops, as in PyTorch; `lax.pad` does both."""
    fill = jnp.asarray(value).astype(x.dtype)
    return lax.pad(x, fill, [(lo, hi, 0) for lo, hi in _pairs(x.ndim, pad)])


def _source_positions(size: int, before: int, after: int, mode: str) -> np.ndarray:
    """For each output position along a padded dim, the input position it copies: output o
    reads input o - before, reflected about the ends ("reflect") or clamped to them ("edge").
    Negative amounts crop, as PyTorch's kernels index."""
    position = np.arange(-before, size + after)
    if mode == "edge":
        return np.clip(position, 0, size - 1)
    position = np.abs(position)
    return np.where(position >= size, 2 * (size - 1) - position, position)


def _mode_pad(x, padding, mode: str):
    """Reflection or replication padding of the trailing dims, as a gather along each padded dim
    with positions known at trace time."""
    for dim, (before, after) in enumerate(_pairs(x.ndim, padding)):
        if before or after:
            x = jnp.take(x, _source_positions(x.shape[dim], before, after, mode), axis=dim)
    return x


_PAD_MODES = {
    aten.reflection_pad1d.default: "reflect",
    aten.reflection_pad2d.default: "reflect",
    aten.reflection_pad3d.default: "reflect",
    aten.replication_pad1d.default: "edge",
    aten.replication_pad2d.default: "edge",
    aten.replication_pad3d.default: "edge",
}
_PAD_BACKWARD = {
    aten.reflection_pad1d_backward.default: "reflect",
    aten.reflection_pad2d_backward.default: "reflect",
    aten.reflection_pad3d_backward.default: "reflect",
    aten.replication_pad1d_backward.default: "edge",
    aten.replication_pad2d_backward.default: "edge",
    aten.replication_pad3d_backward.default: "edge",
}


@registry.register(*_PAD_MODES)
def mode_pad(ctx, x, padding):
    return _mode_pad(x, padding, _PAD_MODES[ctx.op])


@registry.register(*_PAD_BACKWARD)
def mode_pad_backward(ctx, grad_output, x, padding):
    """The adjoint of the padding: each padded element's gradient flows back to its source."""
    pad = partial(_mode_pad, padding=padding, mode=_PAD_BACKWARD[ctx.op])
    return views.transpose_view(pad, x.shape, ctx.out_dtype(), grad_output)


# --- reorderings and repeats -------------------------------------------------------------------


@registry.register(aten.flip.default)
def flip(ctx, x, dims):
    return jnp.flip(x, tuple(canonical_dim(d, x.ndim) for d in dims)) if dims else x


@registry.register(aten.roll.default)
def roll(ctx, x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(canonical_dim(d, x.ndim) for d in dims))


@registry.register(aten.repeat.default)
def repeat(ctx, x, repeats):
    return jnp.tile(x, tuple(repeats))


@registry.register(aten.tril.default)
def tril(ctx, x, diagonal=0):
    return jnp.tril(x, diagonal)


@registry.register(aten.triu.default)
def triu(ctx, x, diagonal=0):
    return jnp.triu(x, diagonal)


@registry.register(aten.diag_embed.default)
def diag_embed(ctx, x, offset=0, dim1=-2, dim2=-1):
    """Each vector along the last dim becomes the `offset` diagonal of a square matrix whose
    dims land at `dim1` and `dim2` of the result."""
    n = x.shape[-1] + abs(offset)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, abs(offset))])
    # Row i of the matrix holds entry i (offset >= 0); column j holds entry j (offset < 0).
    values = padded[..., :, None] if offset >= 0 else padded[..., None, :]
    matrix = jnp.where(np.eye(n, k=offset, dtype=bool), values, jnp.zeros((), x.dtype))
    ndim = x.ndim + 1
    return jnp.moveaxis(matrix, (-2, -1), (canonical_dim(dim1, ndim), canonical_dim(dim2, ndim)))


# --- scatters into views, and the backward ops of views ------------------------------------------


@registry.register(aten.select_scatter.default)
def select_scatter(ctx, x, src, dim, index):
    return views.scatter_into_view(partial(views.select, dim=dim, index=index), x, src)


@registry.register(aten.slice_scatter.default)
def slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    view = partial(views.slice_dim, dim=dim, start=start, end=end, step=step)
    return views.scatter_into_view(view, x, src)


@registry.register(aten.diagonal_scatter.default)
def diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    return views.scatter_into_view(partial(views.diagonal, offset=offset, dim1=dim1, dim2=dim2), x, src)


@registry.register(aten.as_strided_scatter.default)
def as_strided_scatter(ctx, x, src, size, stride, storage_offset=None):
    """`x` with `src` written where `as_strided(size, stride, storage_offset)` reads in a copy of
    `x`: PyTorch's kernel, which copies `x` keeping its strides (a contiguous copy where a stride
    0 makes `x` overlap itself). A compiled graph holds this op where the model writes into an
    `as_strided` view, and `x` is then the view's base, its whole storage. Positions count from
    `x`'s first element; for a view into a larger storage, PyTorch's kernel counts from the
    storage's, which lies outside `x`'s value. A view that reads an element twice raises: where
    two writes land is PyTorch's iteration order, which a scatter does not keep."""
    meta = ctx.arg("self")
    if any(n > 1 and s == 0 for n, s in zip(meta.shape, meta.stride())):
        strides, base = torch.empty(meta.shape, device="meta").stride(), 0
    else:
        strides, base = meta.stride(), meta.storage_offset()
    written = _storage_positions(size, stride, base if storage_offset is None else storage_offset).reshape(-1)
    if np.unique(written).size < written.size:
        raise ValueError(
            f"as_strided_scatter: the view of size {tuple(size)} and stride {tuple(stride)} refers to some "
            f"storage elements more than once; clone() its result before writing into it")
    order = np.argsort(written, kind="stable")
    positions = _storage_positions(meta.shape, strides, base)
    at = np.minimum(np.searchsorted(written[order], positions), max(written.size - 1, 0))
    found = written.size > 0 and (written[order][at] == positions)
    if not np.any(found):
        return x
    source = jnp.asarray(src, x.dtype).reshape(-1)[np.where(found, order[at], 0)]
    return jnp.where(found, source, x)


def _storage_positions(sizes, strides, offset: int) -> np.ndarray:
    """The storage element each element of a tensor of `sizes`, `strides` and `offset` reads."""
    positions = np.full(tuple(sizes), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(sizes, strides)):
        positions += np.arange(n, dtype=np.int64).reshape([-1 if i == d else 1 for i in range(len(sizes))]) * s
    return positions


@registry.register(aten.select_backward.default)
def select_backward(ctx, grad_output, input_sizes, dim, index):
    view = partial(views.select, dim=dim, index=index)
    return views.transpose_view(view, input_sizes, ctx.out_dtype(), grad_output)


@registry.register(aten.slice_backward.default)
def slice_backward(ctx, grad_output, input_sizes, dim, start, end, step):
    view = partial(views.slice_dim, dim=dim, start=start, end=end, step=step)
    return views.transpose_view(view, input_sizes, ctx.out_dtype(), grad_output)


@registry.register(aten.diagonal_backward.default)
def diagonal_backward(ctx, grad_output, input_sizes, offset, dim1, dim2):
    view = partial(views.diagonal, offset=offset, dim1=dim1, dim2=dim2)
    return views.transpose_view(view, input_sizes, ctx.out_dtype(), grad_output)


@registry.register(aten.unfold_backward.default)
def unfold_backward(ctx, grad_in, input_sizes, dim, size, step):
    """Overlapping windows sum their gradients: exactly the adjoint of `unfold`."""
    view = partial(views.unfold, dim=dim, size=size, step=step)
    return views.transpose_view(view, input_sizes, ctx.out_dtype(), grad_in)
