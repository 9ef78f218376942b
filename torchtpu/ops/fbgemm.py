"""FBGEMM's data-distribution ops on `tpu` tensors: the ones TorchRec's sharded modules call.

Every FBGEMM op reaches the tpu backend through its PrivateUse1 key; without a kernel there it
would take the generic CPU fallback, and ops whose autograd FBGEMM registers per device
(`permute_pooled_embs_auto_grad_split`, column-wise sharding's output permutation) would lose
their gradient. Each op here gets an explicit tpu kernel of one of two kinds:

* composites of lowered ATen ops, so they run on the device and autograd differentiates them:
  the pooled-embedding permutations (a column `index_select`; the column index is built on the
  host from the small offset and permutation lists), the regroupings of KeyedTensors
  (`permute_multi_embedding`: slices and concatenations) and row selections
  (`group_index_select_dim0`), the cumulative sums of offsets, the positions within segments
  (`offsets_range`), the sums of segments (`segment_sum_csr`), inverse permutations and, under
  FBGEMM's own autograd, the jagged <-> padded dense conversions, the selection of
  segments (`jagged_index_select`) and their adjoints (row gathers and scatters of static shape);
* host staging, for ops whose output sizes depend on the ids (permuting and bucketizing jagged
  ids): the inputs are copied to the host, FBGEMM's CPU kernel runs, the outputs are copied back.
  These ops work on integer ids and lengths (and per-id weights, which they only move), never
  on anything that needs a gradient. The staging is counted (`counters`: `fbgemm_host_staged`).

They are installed when `torchrec_plugin` is imported, and otherwise by the first FBGEMM op that
reaches a tpu tensor (`torchtpu.exec.kernels.fallback`): torchtpu does not import FBGEMM itself
(its import takes seconds), yet TorchRec's types (`KeyedTensor.regroup`,
`KeyedJaggedTensor.permute`) must run on the device wherever they are used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchtpu import counters

__all__ = ["HOST_STAGED", "PERMUTE_POOLED", "install"]

PERMUTE_POOLED = (
    "permute_pooled_embs",
    "permute_pooled_embs_split",
    "permute_pooled_embs_auto_grad",
    "permute_pooled_embs_auto_grad_split",
)
"""Column permutations of pooled embeddings `[batch, sum of dims]` (differentiable on tpu)."""

HOST_STAGED = (
    "permute_1D_sparse_data",
    "permute_2D_sparse_data",
    "permute_2D_sparse_data_input1D",  # TorchRec's KJT permute under torch.compile
    "block_bucketize_sparse_features",
    "expand_into_jagged_permute",
)
"""Jagged id permutations and bucketizations, run by FBGEMM's CPU kernels."""

_libraries: list[torch.library.Library] = []


def _column_index(offset_dim_list: torch.Tensor, permute_list: torch.Tensor) -> torch.Tensor:
    """Source column of every output column: output segment i is input segment permute[i]."""
    offsets = offset_dim_list.cpu().tolist()
    columns = [c for source in permute_list.cpu().tolist() for c in range(offsets[source], offsets[source + 1])]
    return torch.tensor(columns, dtype=torch.int64)


def permute_pooled_embs(pooled_embs: torch.Tensor, offset_dim_list: torch.Tensor, permute_list: torch.Tensor,
                        inv_offset_dim_list: torch.Tensor, inv_permute_list: torch.Tensor) -> torch.Tensor:
    """FBGEMM's `permute_pooled_embs`: the feature blocks of each row in `permute_list` order.
    An `index_select` of columns, so its gradient is the inverse permutation (the `inv_*` lists
    FBGEMM's backward uses are implied)."""
    index = _column_index(offset_dim_list, permute_list).to(pooled_embs.device)
    return pooled_embs.index_select(1, index)


def group_index_select_dim0(input_group: list[torch.Tensor], indices_group: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each input's rows at its indices: TorchRec's EmbeddingBagCollection expands deduplicated
    pooled embeddings with it (`inverse_indices`). `index_select`s, so autograd differentiates
    them."""
    if len(input_group) != len(indices_group):
        raise ValueError(f"fbgemm.group_index_select_dim0: {len(input_group)} inputs and {len(indices_group)} "
                         f"index tensors; expected one index tensor per input")
    return [x.index_select(0, index) for x, index in zip(input_group, indices_group)]


def _host_regroup_arguments(dtype: torch.dtype, keys: list[list[str]], lengths: list[list[int]],
                            groups: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """FBGEMM's plan for regrouping KeyedTensors' columns, made on the host by its CPU kernel
    from the keys and lengths alone (the embeddings' tensor gives it only a device)."""
    return torch.ops.fbgemm.kt_regroup_arguments(torch.empty(0, dtype=dtype), keys, lengths, groups)


def kt_regroup_arguments(embs: torch.Tensor, keys: list[list[str]], lengths: list[list[int]],
                         groups: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """`permute_multi_embedding`'s arguments (`_host_regroup_arguments`), put on `embs`' device."""
    permutes, in_shapes, out_shapes, out_lengths = _host_regroup_arguments(embs.dtype, keys, lengths, groups)
    return permutes.to(embs.device), in_shapes.to(embs.device), out_shapes.to(embs.device), out_lengths


def _regroup_plan(permutes: torch.Tensor, outputs: int) -> list[list[tuple[int, int, int]]]:
    """Per output tensor, its pieces in column order as (input tensor, first column, columns),
    from FBGEMM's `permutes` rows [input, output, input start, output start, length, jump]. Read
    to the host once per permutes tensor and version (kept on the tensor; counted as
    `fbgemm_regroup_plans_read` where it is a device tensor): `KTRegroupAsDict` keeps one on the
    device and passes it every step."""
    cached = getattr(permutes, "_torchtpu_regroup_plan", None)
    if cached is not None and cached[0] == permutes._version:
        return cached[1]
    if permutes.device.type != "cpu":
        counters.count("fbgemm_regroup_plans_read")
    rows = sorted(permutes.cpu().tolist(), key=lambda row: (row[1], row[3]))
    plan: list[list[tuple[int, int, int]]] = [[] for _ in range(outputs)]
    for source, output, source_start, _, length, _ in rows:
        plan[output].append((source, source_start, length))
    permutes._torchtpu_regroup_plan = (permutes._version, plan)
    return plan


def permute_multi_embedding(pooled_embs: list[torch.Tensor], permutes: torch.Tensor, in_shapes: torch.Tensor,
                            out_shapes: torch.Tensor, out_lengths: list[int]) -> list[torch.Tensor]:
    """KeyedTensors' columns regrouped (TorchRec's `KTRegroupAsDict`, `regroup_kts`): each output
    the concatenation of the input column ranges `permutes` assigns it, in order (the shapes
    FBGEMM's kernel addresses memory with are implied). Slices and concatenations, so autograd
    differentiates them (a key in two groups gets both gradients)."""
    plan = _regroup_plan(permutes, len(out_lengths))
    batch = pooled_embs[0].shape[0] if pooled_embs else 0
    outs = []
    for output, (pieces, length) in enumerate(zip(plan, out_lengths)):
        columns = [pooled_embs[source][:, start:start + n] for source, start, n in pieces]
        if sum(n for _, _, n in pieces) != length:
            raise ValueError(f"fbgemm.permute_multi_embedding: output {output} is given "
                             f"{sum(n for _, _, n in pieces)} columns by permutes, but out_lengths says {length}")
        outs.append(torch.cat(columns, 1) if columns else pooled_embs[0].new_empty((batch, 0)))
    return outs


def regroup_keyed_tensor(values: list[torch.Tensor], keys: list[list[str]], lengths: list[list[int]],
                         groups: list[list[str]]) -> list[torch.Tensor]:
    """`permute_multi_embedding` with the plan made on the host (`regroup_kts` makes it every call:
    it never goes to the device and back)."""
    permutes, in_shapes, out_shapes, out_lengths = _host_regroup_arguments(values[0].dtype, keys, lengths, groups)
    return permute_multi_embedding(values, permutes, in_shapes, out_shapes, out_lengths)


def invert_permute(permute: torch.Tensor) -> torch.Tensor:
    """The inverse permutation: `result[permute[i]] = i`."""
    positions = torch.arange(permute.shape[0], dtype=permute.dtype, device=permute.device)
    return torch.empty_like(permute).scatter_(0, permute.to(torch.int64), positions)


def asynchronous_complete_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    """`[0, cumsum(t_in)...]`: offsets from lengths."""
    return torch.cat([torch.zeros(1, dtype=t_in.dtype, device=t_in.device), torch.cumsum(t_in, 0, dtype=t_in.dtype)])


def asynchronous_exclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t_in, 0, dtype=t_in.dtype) - t_in


def asynchronous_inclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t_in, 0, dtype=t_in.dtype)


def offsets_range(offsets: torch.Tensor, range_size: int) -> torch.Tensor:
    """Each of `range_size` positions' place within its segment: segment k starts at
    `offsets[k]` and runs to the next start (the last to `range_size`). TorchRec's
    `PositionWeightedModule` numbers ids within their bags with it."""
    position = torch.arange(range_size, dtype=offsets.dtype, device=offsets.device)
    segment = (torch.searchsorted(offsets, position, right=True) - 1).clamp(min=0)
    return position - offsets.index_select(0, segment) if offsets.shape[0] else position


def segment_sum_csr(batch_size: int, csr_seg: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Sums of `values` over segments of whole batches: segment i is `values[csr_seg[i] *
    batch_size : csr_seg[i + 1] * batch_size]`. TorchRec sums the lengths of each key or rank
    with it. A segment running past the values' end is a device-side check (FBGEMM's CPU kernel
    reads beyond them)."""
    flat = values.reshape(-1)
    bounds = csr_seg.to(torch.int64) * batch_size
    segments = bounds.shape[0] - 1
    sums = torch.zeros(max(segments, 0), dtype=values.dtype, device=values.device)
    if segments <= 0:
        return sums
    torch._assert_async(bounds[-1] <= flat.shape[0], "fbgemm.segment_sum_csr: the last segment ends "
                        "past the values (csr_seg[-1] * batch_size > values.numel())")
    position = torch.arange(flat.shape[0], device=flat.device)
    segment = torch.searchsorted(bounds, position, right=True) - 1
    inside = (segment >= 0) & (segment < segments)
    return sums.index_add(0, torch.where(inside, segment, 0), torch.where(inside, flat, 0))


_DIFFERENTIABLE = {
    **{name: permute_pooled_embs for name in PERMUTE_POOLED},
    "group_index_select_dim0": group_index_select_dim0,
    "permute_multi_embedding": permute_multi_embedding,
    "regroup_keyed_tensor": regroup_keyed_tensor,
}
"""Ops of pooled embeddings, whose autograd FBGEMM registers itself: on tpu, autograd
differentiates the composites."""

_OFFSETS = {
    "kt_regroup_arguments": kt_regroup_arguments,
    "invert_permute": invert_permute,
    "asynchronous_complete_cumsum": asynchronous_complete_cumsum,
    "asynchronous_exclusive_cumsum": asynchronous_exclusive_cumsum,
    "asynchronous_inclusive_cumsum": asynchronous_inclusive_cumsum,
    "offsets_range": offsets_range,
    "segment_sum_csr": segment_sum_csr,
}
"""Offsets arithmetic: offsets from lengths, positions within segments, sums of segments, inverse
permutations, the plan of a KeyedTensor regrouping."""


def _one_jagged_dimension(name: str, offsets: list[torch.Tensor]) -> torch.Tensor:
    if len(offsets) != 1:
        raise NotImplementedError(
            f"fbgemm.{name} on tpu: one jagged dimension (TorchRec's JaggedTensor), got {len(offsets)} offset tensors"
        )
    return offsets[0].to(torch.int64)


def _padding(value: float, dtype: torch.dtype) -> float | int | bool:
    """`value` as FBGEMM's CPU kernels cast it to the values' dtype (toward zero for integers)."""
    if dtype == torch.bool:
        return bool(value)
    return value if dtype.is_floating_point or dtype.is_complex else int(value)


def jagged_to_padded_dense_forward(values: torch.Tensor, offsets: list[torch.Tensor], max_lengths: list[int],
                                   padding_value: float = 0.0) -> torch.Tensor:
    """`[batch, max_length, *values.shape[1:]]`: segment b's rows `values[offsets[b]:offsets[b + 1]]`,
    cut at `max_length` or padded with `padding_value`. A gather of rows, so the shapes are static."""
    offset = _one_jagged_dimension("jagged_to_padded_dense", offsets)
    (length,) = max_lengths
    batch = offset.shape[0] - 1
    positions = torch.arange(length, device=values.device)
    valid = positions[None, :] < (offset[1:] - offset[:-1])[:, None]
    shape = (batch, length, *values.shape[1:])
    padding = _padding(padding_value, values.dtype)
    if values.shape[0] == 0:
        return torch.full(shape, padding, dtype=values.dtype, device=values.device)
    index = torch.where(valid, offset[:-1, None] + positions[None, :], 0)
    rows = values.reshape(values.shape[0], -1).index_select(0, index.reshape(-1)).reshape(batch, length, -1)
    return torch.where(valid[..., None], rows, padding).reshape(shape)


def dense_to_jagged_forward(dense: torch.Tensor, x_offsets: list[torch.Tensor],
                            total_L: int | None = None) -> torch.Tensor:
    """`[total_L, *dense.shape[2:]]`: row i of segment b is `dense[b, i]`, zero past
    `dense.shape[1]`. `total_L` defaults to the last offset (read to the host: the size is the
    data's)."""
    offset = _one_jagged_dimension("dense_to_jagged", x_offsets)
    batch, length = dense.shape[0], dense.shape[1]
    if offset.shape[0] != batch + 1:
        raise ValueError(f"fbgemm.dense_to_jagged: {offset.shape[0]} offsets for a dense batch of {batch}, "
                         f"expected {batch + 1}")
    total = int(offset[-1]) if total_L is None else total_L
    shape = (total, *dense.shape[2:])
    if batch * length == 0:
        return torch.zeros(shape, dtype=dense.dtype, device=dense.device)
    row = torch.arange(total, device=dense.device)
    segment = torch.searchsorted(offset[1:], row, right=True)
    position = row - offset.index_select(0, segment.clamp(max=batch - 1))
    valid = (segment < batch) & (position < length)
    index = torch.where(valid, segment * length + position, 0)
    rows = dense.reshape(batch * length, -1).index_select(0, index)
    return torch.where(valid[:, None], rows, 0).reshape(shape)


def jagged_to_padded_dense_backward(grad_output: torch.Tensor, offsets: list[torch.Tensor],
                                    total_L: int) -> torch.Tensor:
    """The adjoint of `jagged_to_padded_dense_forward`: each value's gradient is its padded
    position's, zero for the rows cut off."""
    return dense_to_jagged_forward(grad_output, offsets, total_L)


def _selected_rows(indices: torch.Tensor, source_offsets: torch.Tensor, selection_offsets: torch.Tensor,
                   rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the `rows` rows of a jagged selection: the source row it copies, and whether it
    is one (rows past the last segment are not). Segment j of the selection is source segment
    `indices[j]`; both offsets are inclusive (each segment's end), as FBGEMM's are."""
    row = torch.arange(rows, device=indices.device)
    segment = torch.searchsorted(selection_offsets, row, right=True)
    inside = segment < selection_offsets.shape[0]
    segment = torch.where(inside, segment, 0)
    selection_start = torch.cat([selection_offsets.new_zeros(1), selection_offsets[:-1]]).index_select(0, segment)
    source_start = torch.cat([source_offsets.new_zeros(1), source_offsets[:-1]]).index_select(
        0, indices.index_select(0, segment))
    return torch.where(inside, source_start + (row - selection_start), 0), inside


def _rows_where(inside: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values`' rows where `inside`, zero rows elsewhere."""
    return torch.where(inside.reshape(-1, *[1] * (values.dim() - 1)), values, 0)


def jagged_index_select_2d_forward(values: torch.Tensor, indices: torch.Tensor, input_offsets: torch.Tensor,
                                   output_offsets: torch.Tensor, num_dense_output_rows: int) -> torch.Tensor:
    """The rows of the segments `indices` names, one after another (`jagged_index_select`, which
    TorchRec's KJT pools use): a gather of `num_dense_output_rows` rows, a static shape."""
    source, inside = _selected_rows(indices, input_offsets, output_offsets, num_dense_output_rows)
    if values.shape[0] == 0:
        return values.new_zeros((num_dense_output_rows, *values.shape[1:]))
    return _rows_where(inside, values.index_select(0, source))


def jagged_index_add_2d_forward(values: torch.Tensor, indices: torch.Tensor, input_offsets: torch.Tensor,
                                output_offsets: torch.Tensor, num_dense_input_rows: int,
                                num_output_rows: int) -> torch.Tensor:
    """The selection's adjoint (its backward): each of the `num_dense_input_rows` rows of `values`
    (laid out by `input_offsets`) added into the row of segment `indices[j]` it was copied from,
    in `num_output_rows` rows laid out by `output_offsets`."""
    target, inside = _selected_rows(indices, output_offsets, input_offsets, num_dense_input_rows)
    return values.new_zeros((num_output_rows, *values.shape[1:])).index_add(0, target, _rows_where(inside, values))


_JAGGED = {
    "jagged_to_padded_dense_forward": jagged_to_padded_dense_forward,
    "jagged_to_padded_dense_backward": jagged_to_padded_dense_backward,
    "dense_to_jagged_forward": dense_to_jagged_forward,
    "jagged_index_select_2d_forward": jagged_index_select_2d_forward,
    "jagged_index_add_2d_forward": jagged_index_add_2d_forward,
}
"""Jagged <-> padded dense conversions (`JaggedTensor.to_padded_dense`) and selections of
segments (`jagged_index_select`), under FBGEMM's autograd."""


def _host_staged(name: str):
    op = getattr(torch.ops.fbgemm, name).default

    def kernel(*args: Any, **kwargs: Any) -> Any:
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        device = next(t.device for t in tensors if t.device.type == "tpu")
        counters.count_op("fbgemm_host_staged", name)
        host_args, host_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), (args, kwargs))
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), op(*host_args, **host_kwargs))

    kernel.__name__ = f"tpu_{name}"
    return kernel


def install() -> bool:
    """Register the tpu kernels, once; whether this call did (not when FBGEMM is not installed)."""
    if _libraries:
        return False
    try:
        import fbgemm_gpu  # noqa: F401  (registers the torch.ops.fbgemm namespace)
    except ImportError:
        return False
    library = torch.library.Library("fbgemm", "IMPL")
    _libraries.append(library)
    for name, fn in _DIFFERENTIABLE.items():
        library.impl(name, fn, "AutogradPrivateUse1")
        library.impl(name, fn, "PrivateUse1")
    for name, fn in (*_OFFSETS.items(), *_JAGGED.items()):
        library.impl(name, fn, "PrivateUse1")
    for name in HOST_STAGED:
        library.impl(name, _host_staged(name), "PrivateUse1")
    return True
