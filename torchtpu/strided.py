"""PyTorch's strided memory model over flat XLA buffers.

Each storage's data is one flat array. A tensor is a region of it: element `i` (a multi-index)
lives at `offset + sum(i_k * stride_k)`. `read` gathers a tensor's logical value from the flat
buffer; `write` returns the flat buffer with the tensor's region replaced. Both run inside traced
computations, so XLA fuses them with the op that uses them.

Three cases, cheapest first:
- dense: the region is a contiguous run in some dimension order (contiguous tensors, transposes,
  channels-last, contiguous slices): one slice, reshape and transpose;
- nested: non-overlapping strides (step slices, `select`, `diagonal`, narrowed inner dims): a 2-D
  slice of the storage seen as rows of the outer stride, reshaped dimension by dimension;
- anything else (overlapping windows such as `unfold`/`as_strided` tricks): an index gather, or a
  scatter for writes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Iterator, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax


class Geometry(NamedTuple):
    """Sizes, strides and storage offset of a tensor, in elements of its dtype."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@functools.lru_cache(maxsize=4096)
def is_dense_run(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when a tensor of these sizes and strides is one contiguous run of memory in some
    dimension order, with no broadcast dimension: `read` slices it and `write` updates it as
    one run at its offset, which may then be a runtime value (see `opcall.DynamicOffset`)."""
    geometry = Geometry(tuple(sizes), tuple(strides), 0)
    kind, dims = _classify(geometry)
    return kind == "dense" and len(dims) == sum(1 for n in sizes if n > 1)


def _core_dims(geometry: Geometry) -> list[int]:
    """Dims that move through memory (size > 1, stride != 0), outermost (largest stride) first."""
    dims = [d for d, (n, s) in enumerate(zip(geometry.sizes, geometry.strides)) if n > 1 and s != 0]
    return sorted(dims, key=lambda d: -abs(geometry.strides[d]))


def _classify(geometry: Geometry) -> tuple[str, list[int]]:
    dims = _core_dims(geometry)
    strides = [geometry.strides[d] for d in dims]
    sizes = [geometry.sizes[d] for d in dims]
    if any(s < 0 for s in strides):
        return "gather", dims
    dense = all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(len(dims) - 1))
    if dense and (not dims or strides[-1] == 1):
        return "dense", dims
    nested = all(strides[i] >= strides[i + 1] * sizes[i + 1] for i in range(len(dims) - 1))
    return ("nested" if nested else "gather"), dims


def _finish(core_value, geometry: Geometry, dims: list[int]):
    """From a value laid out over `dims` (memory order) to the tensor's logical shape."""
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    value = jnp.transpose(core_value, order) if order != list(range(len(dims))) else core_value
    kept = sorted(dims)
    shape = [geometry.sizes[d] if d in kept else 1 for d in range(len(geometry.sizes))]
    value = value.reshape(shape)
    return jnp.broadcast_to(value, geometry.sizes) if tuple(shape) != geometry.sizes else value


def _indices(geometry: Geometry):
    index = jnp.full(geometry.sizes, geometry.offset, dtype=jnp.int64)
    for d, (n, s) in enumerate(zip(geometry.sizes, geometry.strides)):
        if n > 1 and s != 0:
            index = index + lax.broadcasted_iota(jnp.int64, geometry.sizes, d) * s
    return index


def bitcast(x, dtype):
    """Reinterpret the bytes of `x`'s last dim as elements of `dtype` (`Tensor.view(dtype)`): the
    last dim shrinks or grows by the ratio of the item sizes. Bool travels as uint8; a complex
    value is its (real, imaginary) pair of floats, as in memory."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if x.dtype.kind == "c":
        parts = _complex_parts(x.dtype)
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1).reshape(*x.shape[:-1], -1)
        return bitcast(x, dtype) if parts != dtype else x
    if dtype.kind == "c":
        pairs = bitcast(x, _complex_parts(dtype))
        pairs = pairs.reshape(*pairs.shape[:-1], -1, 2)
        return lax.complex(pairs[..., 0], pairs[..., 1])
    src = np.dtype(np.uint8) if x.dtype == np.bool_ else x.dtype
    dst = np.dtype(np.uint8) if dtype == np.bool_ else dtype
    x = x.astype(np.uint8) if x.dtype == np.bool_ else x
    if src.itemsize == dst.itemsize:
        out = lax.bitcast_convert_type(x, dst)
    elif src.itemsize > dst.itemsize:
        out = lax.bitcast_convert_type(x, dst).reshape(*x.shape[:-1], -1)
    else:
        out = lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, dst.itemsize // src.itemsize), dst)
    return out.astype(np.bool_) if dtype == np.bool_ else out


def _complex_parts(dtype: np.dtype) -> np.dtype:
    """The float dtype of a complex dtype's real and imaginary parts."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.complex64 else np.dtype(np.float64)


def reinterpret(flat, dtype):
    """View a flat buffer as elements of another dtype (a tensor viewing its storage with
    another dtype: `Tensor.view(dtype)`, `view_as_real`)."""
    return bitcast(flat, dtype)


def read(flat, geometry: Geometry):
    """The logical value of the tensor `geometry` describes, from its storage's flat buffer."""
    sizes, strides, offset = geometry
    if geometry.numel == 0:
        return jnp.zeros(sizes, flat.dtype)
    kind, dims = _classify(geometry)
    if kind == "gather":
        return flat[_indices(geometry)]
    core_sizes = [sizes[d] for d in dims]
    if kind == "dense":
        count = math.prod(core_sizes)
        if count == flat.shape[0]:  # the whole storage (a view of it lies inside it: offset 0)
            core = flat.reshape(core_sizes)
        elif isinstance(offset, int):
            core = lax.slice(flat, (offset,), (offset + count,)).reshape(core_sizes)
        else:  # a runtime offset
            core = lax.dynamic_slice(flat, (offset,), (count,)).reshape(core_sizes)
        return _finish(core, geometry, dims)
    core_strides = [strides[d] for d in dims]
    block = _rows(flat, offset, core_sizes, core_strides)
    for n, s in zip(core_sizes[1:], core_strides[1:]):
        if s == 1:  # the innermost dim, contiguous: the first n columns
            return _finish(lax.slice_in_dim(block, 0, n, axis=block.ndim - 1), geometry, dims)
        block = block[..., : n * s].reshape(*block.shape[:-1], n, s)
    return _finish(block[..., 0], geometry, dims)


def _rows(flat, offset: int, core_sizes: list[int], core_strides: list[int]):
    """The `[n0, s0]` block of a nested region (outermost size n0, stride s0) starting at `offset`:
    row `i` holds the `s0` elements from `offset + i * s0` on (of which the inner dims use a prefix).

    When the region's inner extent fits in its row of the storage seen as `[rows, s0]` (a column
    block: `x[:, a:b]`, a `select` of an inner dim), this is a 2-D slice of that matrix, padded
    only on the block's own columns: no pass over the whole storage (unless its length is not a
    multiple of `s0`: it is then padded to whole rows), and under `one_trace` the views of one
    storage are slices of one array, which XLA sees through. Otherwise (a region
    that wraps past a row's end) the storage is read from `offset` as flat."""
    n0, s0 = core_sizes[0], core_strides[0]
    row, col = divmod(offset, s0)
    extent = 1 + sum((n - 1) * s for n, s in zip(core_sizes[1:], core_strides[1:]))
    if col + extent <= s0:
        block = lax.slice(_as_rows(flat, s0), (row, col), (row + n0, col + extent))
        width = core_sizes[1] * core_strides[1] if len(core_sizes) > 1 else 1
        return jnp.pad(block, ((0, 0), (0, width - extent))) if width > extent else block
    span = n0 * s0
    if offset + span > flat.shape[0]:
        flat = jnp.pad(flat, (0, offset + span - flat.shape[0]))
    return lax.slice(flat, (offset,), (offset + span,)).reshape(n0, s0)


class _Traced(threading.local):
    rows: dict | None = None


_traced = _Traced()


@contextlib.contextmanager
def one_trace() -> Iterator[None]:
    """Within one traced computation (a DeferAndFuse graph), reads of one storage by rows of one
    length share a single reshape of it.

    XLA folds a concatenation of adjacent slices of one array back into the array -- TorchRec's
    `KeyedTensor.to_dict()` then `cat` of the pooled embeddings, every DLRM step, forward and
    backward -- but only when the slices are of the same instruction: the identical reshapes
    that reads traced one by one would make are merged only after that simplification runs."""
    outer, _traced.rows = _traced.rows, {}
    try:
        yield
    finally:
        _traced.rows = outer


def _as_rows(flat, length: int):
    """`flat` as `[rows, length]` (zero-padded to whole rows), once per trace under `one_trace`."""
    table = _traced.rows
    key = (id(flat), length)
    if table is not None and key in table and table[key][0] is flat:
        return table[key][1]
    rows = -(-flat.shape[0] // length)
    padded = jnp.pad(flat, (0, rows * length - flat.shape[0])) if rows * length > flat.shape[0] else flat
    matrix = padded.reshape(rows, length)
    if table is not None:
        table[key] = (flat, matrix)  # `flat` held, so its id stays its own while the entry lives
    return matrix


def write(flat, geometry: Geometry, value):
    """`flat` with the region of the tensor `geometry` describes replaced by `value`."""
    value = jnp.asarray(value, flat.dtype)
    if geometry.numel == 0:
        return flat
    value = jnp.broadcast_to(value, geometry.sizes)
    kind, dims = _classify(geometry)
    if kind == "dense" and len(dims) == sum(1 for n in geometry.sizes if n > 1):
        squeezed = value.reshape([n for n in geometry.sizes if n > 1])
        run = jnp.transpose(squeezed, _memory_order(geometry, dims)).reshape(-1)
        if run.shape[0] == flat.shape[0]:  # the whole storage
            return run
        return lax.dynamic_update_slice(flat, run, (geometry.offset,))
    return flat.at[_indices(geometry).reshape(-1)].set(value.reshape(-1))


def _memory_order(geometry: Geometry, dims: list[int]) -> list[int]:
    """Permutation taking the squeezed logical value to memory (largest stride first) order."""
    squeezed = [d for d, n in enumerate(geometry.sizes) if n > 1]
    return [squeezed.index(d) for d in dims]
