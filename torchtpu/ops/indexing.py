"""Indexing: gather and scatter (with reductions), advanced indexing and `index_put`,
`index_select`/`index_reduce`, masked fill and scatter, `put`.

Out-of-range indices are errors, as in PyTorch, reported as device-side checks
(`torchtpu.exec.checks`): raised at the next synchronisation rather than after every indexing op,
which would serialise the device. Until then a read out of range yields the gather fill value
(NaN for floats, the most negative value for signed integers, the largest for unsigned, True for
bool) and a write out of range is not applied. Negative indices wrap where PyTorch wraps them
(advanced indexing, `index_put`, `put`) and are out of range elsewhere (`gather`, `scatter*`,
`index_select`, `index_reduce`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops import registry, views
from torchtpu.ops.views import canonical_dim

aten = torch.ops.aten

READ = dict(mode="fill")
WRITE = dict(mode="drop")
STRICT = dict(wrap_negative_indices=False)


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (np.bool_, np.uint8)


def check_range(ctx, index, size: int, what: str, wrap_negative: bool = False) -> None:
    """A device-side check that every element of `index` addresses one of `size` positions."""
    low = -size if wrap_negative else 0
    ctx.check((index >= low) & (index < size), f"index out of range for {what} of size {size} "
              f"(valid: {low}..{size - 1})")


# --- gather / scatter along one dim -------------------------------------------------------------


def _at_least_1d(x):
    return x.reshape(1) if x.ndim == 0 else x


def _leading_block(x, shape):
    """`x[:shape[0], :shape[1], ...]`: PyTorch's scatter/gather use only the block of `src` (and
    of `self`, for gather) that the index covers."""
    return lax.slice(x, (0,) * x.ndim, tuple(shape)) if tuple(x.shape) != tuple(shape) else x


@registry.register(aten.gather.default)
def gather(ctx, x, dim, index, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(ctx.out_shape(), x.dtype)
    x, index = _at_least_1d(x), _at_least_1d(index)
    dim = canonical_dim(dim, x.ndim)
    block = [n if d != dim else x.shape[d] for d, n in enumerate(index.shape)]
    check_range(ctx, index, x.shape[dim], f"dimension {dim}")
    out = jnp.take_along_axis(_leading_block(x, block), index, axis=dim, **READ, **STRICT)
    return out.reshape(ctx.out_shape())


def _scatter_coordinates(ndim: int, dim: int, index) -> tuple:
    """Full coordinates of the elements `index` addresses: `index` along `dim`, the element's
    own position along every other dim."""
    return tuple(
        index if d == dim else lax.broadcasted_iota(index.dtype, index.shape, d) for d in range(ndim)
    )


def _identity(reduce: str, dtype):
    """The value an addressed position starts from when `include_self=False`."""
    if reduce in ("sum", "mean"):
        value = 0
    elif reduce == "prod":
        value = 1
    elif dtype == np.bool_:
        value = reduce == "amin"
    elif jnp.issubdtype(dtype, jnp.floating):
        value = -jnp.inf if reduce == "amax" else jnp.inf
    else:
        info = jnp.iinfo(dtype)
        value = info.min if reduce == "amax" else info.max
    return jnp.asarray(value, dtype)


def _scatter(ctx, x, dim: int, index, src, reduce: str, include_self: bool = True):
    """`scatter_reduce_along` with the range of `index` checked, shaped as the op's output."""
    if index.size:
        check_range(ctx, index, _at_least_1d(x).shape[canonical_dim(dim, max(x.ndim, 1))],
                    f"dimension {dim}")
    return scatter_reduce_along(x, dim, index, src, reduce, include_self).reshape(ctx.out_shape())


def scatter_reduce_along(x, dim: int, index, src, reduce: str, include_self: bool = True):
    """`x` with `src` reduced into the positions `index` gives along `dim` ("set" replaces).

    `include_self=False` starts every addressed position from the reduction's identity; "mean"
    divides by the number of values reduced there (floor division for integers, as PyTorch).
    """
    x, index, src = _at_least_1d(x), _at_least_1d(index), _at_least_1d(jnp.asarray(src, x.dtype))
    dim = canonical_dim(dim, x.ndim)
    src = jnp.broadcast_to(src, index.shape) if src.ndim == 0 or src.size == 1 else src
    src = _leading_block(src, index.shape)
    at = x.at[_scatter_coordinates(x.ndim, dim, index)]
    if reduce == "set":
        return at.set(src, **WRITE, **STRICT)
    if not include_self:
        x = at.set(_identity(reduce, x.dtype), **WRITE, **STRICT)
        at = x.at[_scatter_coordinates(x.ndim, dim, index)]
    if reduce in ("sum", "mean"):
        total = at.add(src, **WRITE, **STRICT)
    elif reduce == "prod":
        total = at.multiply(src, **WRITE, **STRICT)
    elif reduce == "amax":
        total = at.max(src, **WRITE, **STRICT)
    elif reduce == "amin":
        total = at.min(src, **WRITE, **STRICT)
    else:
        raise ValueError(f"unknown scatter reduction {reduce!r}")
    if reduce != "mean":
        return total
    counts = jnp.ones(x.shape, x.dtype)
    coordinates = _scatter_coordinates(x.ndim, dim, index)
    if not include_self:
        counts = counts.at[coordinates].set(0, **WRITE, **STRICT)
    counts = counts.at[coordinates].add(1, **WRITE, **STRICT)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.floor_divide(total, counts)
    return total / counts


_LEGACY_REDUCE = {"add": "sum", "multiply": "prod"}


@registry.register(aten.scatter.src, aten.scatter.value, dynamic_scalars=True)
def scatter(ctx, x, dim, index, src):
    return _scatter(ctx, x, dim, index, src, "set")


@registry.register(aten.scatter.reduce, aten.scatter.value_reduce, dynamic_scalars=True)
def scatter_legacy_reduce(ctx, x, dim, index, src, *, reduce):
    if reduce not in _LEGACY_REDUCE:
        raise ValueError(f"scatter: reduce must be 'add' or 'multiply', got {reduce!r}")
    return _scatter(ctx, x, dim, index, src, _LEGACY_REDUCE[reduce])


@registry.register(aten.scatter_add.default)
def scatter_add(ctx, x, dim, index, src):
    return _scatter(ctx, x, dim, index, src, "sum")


@registry.register(aten.scatter_reduce.two)
def scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    return _scatter(ctx, x, dim, index, src, reduce, include_self)


# --- index_select / index_reduce: a 1-D index along one dim ---------------------------------------


def _along(dim: int, index) -> tuple:
    return (slice(None),) * dim + (index,)


@registry.register(aten.index_select.default)
def index_select(ctx, x, dim, index):
    x = _at_least_1d(x)
    dim = canonical_dim(dim, x.ndim)
    check_range(ctx, index, x.shape[dim], f"dimension {dim}")
    out = x.at[_along(dim, index.reshape(-1))].get(**READ, **STRICT)
    return out.reshape(ctx.out_shape())


@registry.register(aten.index_reduce.default)
def index_reduce(ctx, x, dim, index, source, reduce, *, include_self=True):
    """`index_reduce` is `scatter_reduce` with the 1-D index repeated across `source`."""
    source = _at_least_1d(source)
    dim = canonical_dim(dim, source.ndim)
    shape = [1] * source.ndim
    shape[dim] = -1
    full_index = jnp.broadcast_to(index.reshape(shape), source.shape)
    return _scatter(ctx, x, dim, full_index, source, reduce, include_self)


# --- advanced indexing ------------------------------------------------------------------------------


def _key(indices) -> tuple:
    return tuple(slice(None) if i is None else i for i in indices)


@registry.register(aten.index.Tensor)
def index(ctx, x, indices):
    """NumPy-style advanced indexing, which PyTorch's follows: the indices broadcast together,
    `None` keeps a dim whole, and the indexed dims move to the front unless adjacent."""
    if any(_is_mask(i) for i in indices):
        raise ValueError(
            "aten.index with a boolean mask has a data-dependent shape; it runs through the "
            "data-dependent path in eager mode and cannot be part of a static program"
        )
    _check_advanced(ctx, x, indices)
    return x.at[_key(indices)].get(**READ)


def _check_advanced(ctx, x, indices) -> None:
    for dim, index in enumerate(indices):
        if index is not None and index.size:
            check_range(ctx, index, x.shape[dim], f"dimension {dim}", wrap_negative=True)


def _mask_rank(mask):
    """For each element of `mask`, how many True elements precede it (in row-major order): the
    position, among the selected elements, of the element if it is selected."""
    return (jnp.cumsum(mask.reshape(-1), dtype=jnp.int64) - 1).reshape(mask.shape)


def _mask_values(x, position: int, mask, values):
    """`values`, which broadcast against `x[(:,) * position + (mask,)]`, laid out over `x`'s
    shape: the k-th selected element takes the k-th value along the selection axis."""
    ndim = x.ndim - mask.ndim + 1
    values = jnp.asarray(values, x.dtype)
    values = values.reshape((1,) * (ndim - values.ndim) + values.shape)
    if values.shape[position] == 1:
        trailing = values.shape[position + 1:]
        laid_out = values.reshape(values.shape[:position] + (1,) * mask.ndim + trailing)
    else:
        laid_out = jnp.take(values, _mask_rank(mask), axis=position, **READ)
    return jnp.broadcast_to(laid_out, x.shape)


def _index_put_mask(x, indices, values, accumulate: bool):
    """`x[..., mask, ...] = values` without reading the mask's count: a select over `x`."""
    positions = [i for i, index in enumerate(indices) if index is not None]
    if len(positions) != 1:
        raise ValueError(
            "index_put with a boolean mask and other index tensors has a data-dependent shape; "
            "use the mask alone (or convert it with nonzero())"
        )
    (position,) = positions
    mask = indices[position].astype(bool)
    covered = x.shape[position:position + mask.ndim]
    if covered != mask.shape:
        raise IndexError(
            f"The shape of the mask {list(mask.shape)} at index {position} does not match the "
            f"shape of the indexed tensor {list(x.shape)}"
        )
    where = mask.reshape((1,) * position + mask.shape + (1,) * (x.ndim - position - mask.ndim))
    update = _mask_values(x, position, mask, values)
    if accumulate:
        return x + jnp.where(where, update, jnp.zeros((), x.dtype))
    return jnp.where(where, update, x)


@registry.register(aten.index_put.default)
def index_put(ctx, x, indices, values, accumulate=False):
    if any(_is_mask(i) for i in indices):
        return _index_put_mask(x, indices, values, accumulate)
    _check_advanced(ctx, x, indices)
    at = x.at[_key(indices)]
    values = jnp.asarray(values, x.dtype)
    return at.add(values, **WRITE) if accumulate else at.set(values, **WRITE)


@registry.register(aten._index_put_impl.default)
def index_put_impl(ctx, x, indices, values, accumulate=False, unsafe=False):
    return index_put(ctx, x, indices, values, accumulate)


@registry.register(aten.put.default)
def put(ctx, x, index, source, accumulate=False):
    """`x.flatten()[index] = source` (negative indices count from the end)."""
    if index.size:
        check_range(ctx, index, x.size, "the flattened tensor", wrap_negative=True)
    at = x.reshape(-1).at[index.reshape(-1)]
    source = source.reshape(-1).astype(x.dtype)
    flat = at.add(source, **WRITE) if accumulate else at.set(source, **WRITE)
    return flat.reshape(x.shape)


# --- masks --------------------------------------------------------------------------------------------


@registry.register(aten.masked_fill.Scalar, aten.masked_fill.Tensor, dynamic_scalars=True)
def masked_fill(ctx, x, mask, value):
    shape = ctx.out_shape()
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x).reshape(shape)


def fill_value(dtype):
    """What a read out of range yields (see the module docstring)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(jnp.nan, dtype)
    if dtype == np.bool_:
        return jnp.asarray(True)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if info.min < 0 else info.max, dtype)


def _masked_take(mask, source, mode: str):
    """For each True of `mask`, in order, the next element of `source` (flattened)."""
    if source.size == 0:
        return jnp.full(mask.shape, fill_value(source.dtype))
    return source.reshape(-1).at[_mask_rank(mask)].get(mode=mode)


@registry.register(aten.masked_scatter.default)
def masked_scatter(ctx, x, mask, source):
    shape = ctx.out_shape()
    mask = jnp.broadcast_to(mask, shape)
    return jnp.where(mask, _masked_take(mask, source.astype(x.dtype), READ["mode"]), x)


@registry.register(aten.masked_scatter_backward.default)
def masked_scatter_backward(ctx, grad_output, mask, sizes):
    """The adjoint of `masked_scatter` in its source."""
    mask = jnp.broadcast_to(mask, grad_output.shape)

    def scatter_source(source):
        return jnp.where(mask, _masked_take(mask, source, "clip"), jnp.zeros((), source.dtype))

    return views.transpose_view(scatter_source, sizes, ctx.out_dtype(), grad_output)
