"""TorchRec's sharding-option enumerator, with column-wise shards as wide as SparseCore holds them.

SparseCore pads a table's columns to the chip's alignment (8 on v4/v5p, 16 on v6e/tpu7x;
`sparsecore.layout`) and refuses a row-wise optimizer on a table narrower than its padded width:
the row-wise slot would average a row's squared gradient over the padding. TorchRec splits a
column-wise table into blocks of the narrowest width of at least `ParameterConstraints.min_partition`
columns (default `MIN_CW_DIM`) that divides the dim and is a multiple of 4, so it proposes shards
of 4 or 12 columns. Here the block is chosen by the same rule with the chip's alignment in place
of 4 -- still at least `min_partition` wide, as that constraint asks -- and a table no such width
divides stays one column-wise shard, as TorchRec keeps it when no block divides.

A table whose dim is not a multiple of the alignment still gets narrow SparseCore shards; under
a row-wise optimizer (the one `apply_optimizer_in_backward` marked it with, else the sharder's
`fused_params`) those options are dropped, so the planner does not pick what sharding would
refuse. Data-parallel options stay (their tables train with the dense optimizer, as in TorchRec);
when nothing remains the planner's error names the table and why.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import MIN_CW_DIM
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlannerError,
    PlannerErrorType,
    Shard,
    ShardEstimator,
    ShardingOption,
)
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ModuleSharder, ShardingType
from torchrec.distributed.utils import convert_to_fbgemm_types, merge_fused_params, optimizer_type_to_emb_opt_type

from sparsecore.layout import round_up
from sparsecore.optimizers import OptimizerSpec
from torchrec_plugin.hardware import TpuTopology
from torchrec_plugin.kernels import sparsecore_optimizer

__all__ = ["TpuEmbeddingEnumerator", "column_block"]

_COLUMN_SPLIT = (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)
"""The sharding types whose shards TorchRec cuts from the columns (`calculate_shard_sizes_and_offsets`)."""


def column_block(dim: int, min_partition: int, alignment: int) -> int:
    """The width of a table's column-wise shards: the narrowest multiple of `alignment`, at least
    `min_partition`, that divides `dim`; `dim` itself when none does."""
    for width in range(round_up(max(min_partition, 1), alignment), dim, alignment):
        if dim % width == 0:
            return width
    return dim


class TpuEmbeddingEnumerator(EmbeddingEnumerator):
    """TorchRec's `EmbeddingEnumerator` whose column-wise options are cut into blocks of
    `column_block` columns for the topology's chip (see the module docstring), then estimated."""

    def __init__(self, topology: TpuTopology, batch_size: int,
                 constraints: dict[str, ParameterConstraints] | None = None,
                 estimator: ShardEstimator | list[ShardEstimator] | None = None) -> None:
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimator)
        self._alignment = topology.chip.embedding_dim_alignment

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        options = super().enumerate(module, sharders)
        recut = [option for option in options if option.sharding_type in _COLUMN_SPLIT and self._recut(option)]
        if recut:
            self.populate_estimates(recut)
        refused: dict[str, dict[str, list[str]]] = {}
        kept = []
        for option in options:
            reason = self._refusal(option)
            if reason is None:
                kept.append(option)
            else:
                refused.setdefault(option.fqn, {}).setdefault(reason, []).append(option.sharding_type)
        for fqn in sorted(refused.keys() - {option.fqn for option in kept}):
            why = "; ".join(f"{', '.join(sorted(types))}: {reason}" for reason, types in refused[fqn].items())
            raise PlannerError(
                f"table {fqn!r} has no sharding option SparseCore accepts ({why}); give it a dim that is a multiple "
                f"of {self._alignment}, allow {ShardingType.DATA_PARALLEL.value}, or use an optimizer without "
                "row-wise slots",
                PlannerErrorType.OTHER,
            )
        self._last_stored_search_space = copy.deepcopy(kept)
        return kept

    def _refusal(self, option: ShardingOption) -> str | None:
        """Why SparseCore would refuse `option` (a shard narrower than its padded width under a
        row-wise optimizer), or None."""
        if option.compute_kernel != EmbeddingComputeKernel.FUSED.value:
            return None
        narrow = sorted({shard.size[1] for shard in option.shards if shard.size[1] % self._alignment})
        if not narrow:
            return None
        optimizer = self._optimizer(option)
        if not any(slot.per_row for slot in optimizer.slots()):
            return None
        return (f"shards of {narrow} columns are padded to a multiple of {self._alignment}, and "
                f"{type(optimizer).__name__}'s row-wise slot would average over the padding")

    def _optimizer(self, option: ShardingOption) -> OptimizerSpec:
        """The SparseCore optimizer TorchRec's sharded module would give `option`'s table: the
        sharder's fused parameters under the optimizer the table is marked with."""
        param = option.tensor
        kwargs: dict[str, Any] = dict(getattr(param, "_optimizer_kwargs", [{}])[0])
        optimizer_class = getattr(param, "_optimizer_classes", [None])[0]
        if optimizer_class is not None and "optimizer" not in kwargs:
            kwargs["optimizer"] = optimizer_type_to_emb_opt_type(optimizer_class)
        sharder = self._sharder_map.get(sharder_name(type(option.module[1])))
        fused = merge_fused_params(getattr(sharder, "fused_params", None), kwargs)
        return sparsecore_optimizer(convert_to_fbgemm_types(fused))

    def _recut(self, option: ShardingOption) -> bool:
        """Give `option` shards of `column_block` columns; False if it has them already."""
        rows, dim = option.tensor.shape
        constraint = (self._constraints or {}).get(option.name)
        min_partition = constraint.min_partition if constraint is not None and constraint.min_partition else MIN_CW_DIM
        width = column_block(dim, min_partition, self._alignment)
        if all(shard.size[1] == width for shard in option.shards):
            return False
        option.shards = [Shard(size=[rows, width], offset=[0, k * width]) for k in range(dim // width)]
        return True
