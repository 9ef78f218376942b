"""FBGEMM's data-distribution ops on `tpu` tensors: the ones TorchRec's sharded modules call.

Every FBGEMM op reaches the tpu backend through its PrivateUse1 key; without a kernel there it
would take the generic CPU fallback, and ops whose autograd FBGEMM registers per device
(`permute_pooled_embs_auto_grad_split`, column-wise sharding's output permutation) would lose
their gradient. Each op here gets an explicit tpu kernel of one of two kinds:

* composites of lowered ATen ops, so they run on the device and autograd differentiates them:
  the pooled-embedding permutations (a column `index_select`; the column index is built on the
  host from the small offset and permutation lists) and the cumulative sums of offsets;
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


def asynchronous_complete_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    """`[0, cumsum(t_in)...]`: offsets from lengths."""
    return torch.cat([torch.zeros(1, dtype=t_in.dtype, device=t_in.device), torch.cumsum(t_in, 0, dtype=t_in.dtype)])


def asynchronous_exclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t_in, 0, dtype=t_in.dtype) - t_in


def asynchronous_inclusive_cumsum(t_in: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t_in, 0, dtype=t_in.dtype)


_CUMSUMS = {
    "asynchronous_complete_cumsum": asynchronous_complete_cumsum,
    "asynchronous_exclusive_cumsum": asynchronous_exclusive_cumsum,
    "asynchronous_inclusive_cumsum": asynchronous_inclusive_cumsum,
}


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
    for name in PERMUTE_POOLED:
        library.impl(name, permute_pooled_embs, "AutogradPrivateUse1")
        library.impl(name, permute_pooled_embs, "PrivateUse1")
    for name, fn in _CUMSUMS.items():
        library.impl(name, fn, "PrivateUse1")
    for name in HOST_STAGED:
        library.impl(name, _host_staged(name), "PrivateUse1")
    return True
