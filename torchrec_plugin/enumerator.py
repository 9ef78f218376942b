"""TorchRec's sharding-option enumerator, with column-wise shards as wide as SparseCore holds them.

SparseCore pads a table's columns to the chip's alignment (8 on v4/v5p, 16 on v6e/tpu7x;
`sparsecore.layout`), so a shard whose width is not a multiple of it carries padding: 4 columns
cost what 8 do. (Such a shard trains like any other: it is a table of its own width, and a
row-wise slot averages over that width, as FBGEMM's does.) TorchRec splits a column-wise table
into blocks of the narrowest width of at least `ParameterConstraints.min_partition` columns
(default `MIN_CW_DIM`) that divides the dim and is a multiple of 4, so it proposes shards of 4 or
12 columns. Here the block is chosen by the same rule with the chip's alignment in place of 4 --
still at least `min_partition` wide, as that constraint asks -- and a table no such width divides
stays one column-wise shard, as TorchRec keeps it when no block divides.
"""

from __future__ import annotations

from torch import nn
from torchrec.distributed.planner.constants import MIN_CW_DIM
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, Shard, ShardEstimator, ShardingOption
from torchrec.distributed.types import ModuleSharder, ShardingType

from sparsecore.layout import round_up
from torchrec_plugin.hardware import TpuTopology

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
        return options

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
