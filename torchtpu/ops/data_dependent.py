"""Ops whose output shape depends on values: nonzero, masked_select, unique (sorted, consecutive,
by dim), repeat_interleave with tensor repeats.

Each reads one number to the host -- how many elements are selected, how many distinct values or
rows there are, how long the repeated output is -- which is one device-to-host sync (in defer
mode it flushes the pending work), then finishes with ops of static shape: chiefly
`nonzero_static`, the one lowering here, plus sorts, cumulative sums and scatters that run like
any other op. Everything here composes `tpu` tensors through the dispatcher, so it holds in every
eager mode.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch

from torchtpu.ops import registry

aten = torch.ops.aten


@registry.register(aten.nonzero_static.default)
def nonzero_static(ctx, x, *, size, fill_value=-1):
    """The first `size` nonzero coordinates in row-major order, padded with `fill_value` rows."""
    if x.ndim == 0 or x.size == 0:
        return jnp.full(ctx.out_shape(), fill_value, jnp.int64)
    coordinates = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(coordinates, axis=1).astype(jnp.int64)


def _host_int(t: torch.Tensor) -> int:
    """The one device-to-host read of a data-dependent op."""
    return int(t.item())


@registry.register_data_dependent(aten.nonzero.default)
def nonzero(x: torch.Tensor) -> torch.Tensor:
    count = _host_int(torch.count_nonzero(x))
    return aten.nonzero_static.default(x, size=count, fill_value=-1)


def masks_to_indices(indices) -> list:
    """Advanced-indexing `indices` with every boolean mask replaced by the coordinates of its
    True elements (one index tensor per dim it covers), as PyTorch expands masks: one host read
    per mask, after which indexing has a static shape."""
    expanded = []
    for index in indices:
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            expanded.extend(nonzero(index).unbind(1))
        else:
            expanded.append(index)
    return expanded


@registry.register_data_dependent(aten.index.Tensor)
def index(x: torch.Tensor, indices) -> torch.Tensor:
    """`x[indices]` in eager mode: boolean masks become coordinates (one host read per mask),
    then the static-shape lowering of `index.Tensor` runs."""
    from torchtpu.exec.kernels import execute

    return execute(aten.index.Tensor, (x, masks_to_indices(indices)), {})


@registry.register_data_dependent(aten.masked_select.default)
def masked_select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    shape = torch.broadcast_shapes(x.shape, mask.shape) or (1,)
    return aten.index.Tensor(x.expand(shape), masks_to_indices([mask.expand(shape)]))


# --- unique ------------------------------------------------------------------------------------------


def _runs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Runs of equal consecutive rows of `rows` (a 1-D tensor: its elements; 2-D: its rows).

    Returns the first position of every run, the run number of every row, and the number of
    runs (the host read). NaNs differ from everything, as in PyTorch.
    """
    length = rows.shape[0]
    different = rows[1:] != rows[:-1]
    if rows.dim() > 1:
        different = different.any(dim=1)
    starts = torch.cat([torch.full((1,), True, device=rows.device), different])
    run = torch.cumsum(starts, 0) - 1
    count = _host_int(run[length - 1]) + 1
    first = aten.nonzero_static.default(starts, size=count, fill_value=-1).squeeze(1)
    return first, run, count


def _unique_rows(rows: torch.Tensor, sort: bool, return_inverse: bool, return_counts: bool):
    """Distinct rows (consecutive runs if not `sort`), the run of every input row, run lengths.

    Sorting is lexicographic and stable: one stable sort per column, last column first.
    """
    length = rows.shape[0]
    empty = torch.empty(0, dtype=torch.int64, device=rows.device)
    if length == 0:
        return rows, empty, empty
    order = None
    if sort:
        keys = rows.unsqueeze(1) if rows.dim() == 1 else rows
        order = torch.arange(length, device=rows.device)
        for column in reversed(range(keys.shape[1])):
            order = order[torch.sort(keys[order, column], stable=True).indices]
        rows = rows[order]
    first, run, count = _runs(rows)
    values = rows.index_select(0, first)
    inverse = empty
    if return_inverse:
        inverse = run if order is None else torch.empty_like(run).scatter_(0, order, run)
    counts = empty
    if return_counts:
        counts = torch.zeros(count, dtype=torch.int64, device=rows.device)
        counts.scatter_add_(0, run, torch.ones_like(run))
    return values, inverse, counts


def _unique_flat(x: torch.Tensor, sort: bool, return_inverse: bool, return_counts: bool):
    values, inverse, counts = _unique_rows(x.reshape(-1), sort, return_inverse, return_counts)
    return values, inverse.reshape(x.shape) if return_inverse else inverse, counts


def _unique_dim(x: torch.Tensor, dim: int, sort: bool, return_inverse: bool, return_counts: bool):
    dim = dim % max(x.dim(), 1)
    if any(n == 0 for d, n in enumerate(x.shape) if d != dim):
        raise RuntimeError(
            "There are 0 sized dimensions, and they aren't selected, so unique cannot be applied"
        )
    moved = x.movedim(dim, 0)
    rows = moved.reshape(moved.shape[0], math.prod(moved.shape[1:]))
    values, inverse, counts = _unique_rows(rows, sort, return_inverse, return_counts)
    values = values.reshape(-1, *moved.shape[1:]).movedim(0, dim)
    return values, inverse, counts


@registry.register_data_dependent(aten._unique2.default)
def unique2(x, sorted=True, return_inverse=False, return_counts=False):
    # PyTorch sorts whatever `sorted` says; so does this.
    return _unique_flat(x, True, return_inverse, return_counts)


@registry.register_data_dependent(aten._unique.default)
def unique(x, sorted=True, return_inverse=False):
    values, inverse, _ = _unique_flat(x, True, return_inverse, False)
    return values, inverse


@registry.register_data_dependent(aten.unique_consecutive.default)
def unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        return _unique_dim(x, dim, False, return_inverse, return_counts)
    return _unique_flat(x, False, return_inverse, return_counts)


@registry.register_data_dependent(aten.unique_dim.default)
def unique_dim(x, dim, sorted=True, return_inverse=False, return_counts=False):
    return _unique_dim(x, dim, True, return_inverse, return_counts)


@registry.register_data_dependent(aten.unique_dim_consecutive.default)
def unique_dim_consecutive(x, dim, return_inverse=False, return_counts=False):
    return _unique_dim(x, dim, False, return_inverse, return_counts)


# --- repeat_interleave -------------------------------------------------------------------------------


@registry.register_data_dependent(aten.repeat_interleave.Tensor)
def repeat_interleave(repeats: torch.Tensor, *, output_size: int | None = None) -> torch.Tensor:
    """`i` repeated `repeats[i]` times. Given `output_size`, nothing is read to the host (and the
    repeats are taken on trust, as PyTorch's CUDA kernel does)."""
    if repeats.dim() != 1:
        raise RuntimeError(f"repeat_interleave only accept 1D vector as repeat, got {repeats.dim()}-D")
    if repeats.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"repeats has to be Long or Int tensor, got {repeats.dtype}")
    ends = torch.cumsum(repeats, 0)
    if output_size is None:
        if repeats.numel() == 0:
            output_size = 0
        else:
            total, smallest = torch.stack([ends[-1], repeats.min()]).cpu().tolist()
            if smallest < 0:
                raise RuntimeError(f"repeats can not be negative, got {smallest}")
            output_size = total
    positions = torch.arange(output_size, device=repeats.device, dtype=ends.dtype)
    return torch.searchsorted(ends, positions, right=True).to(repeats.dtype)
