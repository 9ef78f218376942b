"""TorchRec's sharding strategies with the lookups of `torchrec_plugin.kernels`.

Each stock strategy (table-wise, row-wise, column-wise, table-row-wise, data-parallel) keeps its
input and output distribution -- the collectives run on `tpu` tensors through the `tpu_dist`
process group -- and only its `create_lookup` changes: the grouped lookup builds SparseCore
kernels for FUSED groups and `DenseEmbeddingBag`s for DENSE ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import (
    BaseGroupedFeatureProcessor,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
)
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType

from torchrec_plugin.kernels import DenseEmbeddingBag, SparseCoreEmbeddingBag

__all__ = ["POOLED_SHARDINGS", "SparseCorePooledLookup"]


class SparseCorePooledLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's grouped pooled lookup with SparseCore (FUSED) and dense (DENSE) kernels."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device: torch.device | None,
                                 pg: dist.ProcessGroup | None, sharding_type: ShardingType | None,
                                 env: ShardingEnv | None) -> SparseCoreEmbeddingBag | DenseEmbeddingBag:
        if config.compute_kernel == EmbeddingComputeKernel.FUSED:
            return SparseCoreEmbeddingBag(config, pg, device)
        if config.compute_kernel == EmbeddingComputeKernel.DENSE:
            return DenseEmbeddingBag(config, pg, device)
        raise ValueError(
            f"tables {config.table_names()}: compute kernel {config.compute_kernel.value!r} is not available on tpu "
            f"(use {EmbeddingComputeKernel.FUSED.value!r} or {EmbeddingComputeKernel.DENSE.value!r})"
        )

    def push(self) -> None:
        """Write every SparseCore kernel's mirror into its tables (after a load or an init)."""
        for kernel in self._emb_modules:
            if isinstance(kernel, SparseCoreEmbeddingBag):
                kernel.push()


class _SparseCoreLookups:
    """`create_lookup` of every strategy below: the stock arguments, our lookup."""

    _LOOKUP_SHARDING_TYPE: ShardingType | None = None
    _SCALE_WEIGHT_GRADIENTS = True

    def _lookup_configs(self) -> list[GroupedEmbeddingConfig]:
        return self._grouped_embedding_configs

    def _lookup_pg(self) -> dist.ProcessGroup | None:
        return self._pg

    def create_lookup(self, device: torch.device | None = None, fused_params: dict[str, Any] | None = None,
                      feature_processor: BaseGroupedFeatureProcessor | None = None) -> SparseCorePooledLookup:
        return SparseCorePooledLookup(
            grouped_configs=self._lookup_configs(),
            pg=self._lookup_pg(),
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            scale_weight_gradients=self._SCALE_WEIGHT_GRADIENTS,
            sharding_type=self._LOOKUP_SHARDING_TYPE,
            env=self._env,
        )


class TwSparseCoreSharding(_SparseCoreLookups, TwPooledEmbeddingSharding):
    """Table-wise: each table whole on one device."""


class RwSparseCoreSharding(_SparseCoreLookups, RwPooledEmbeddingSharding):
    """Row-wise: each table in contiguous row blocks over every device."""

    _LOOKUP_SHARDING_TYPE = ShardingType.ROW_WISE


class CwSparseCoreSharding(_SparseCoreLookups, CwPooledEmbeddingSharding):
    """Column-wise: each table in column blocks, each block table-wise."""


class TwRwSparseCoreSharding(_SparseCoreLookups, TwRwPooledEmbeddingSharding):
    """Table-row-wise: each table row-wise over the devices of one host."""

    _LOOKUP_SHARDING_TYPE = ShardingType.TABLE_ROW_WISE

    def _lookup_configs(self) -> list[GroupedEmbeddingConfig]:
        return self._grouped_embedding_configs_per_rank[self._rank]


class DpSparseCoreSharding(_SparseCoreLookups, DpPooledEmbeddingSharding):
    """Data-parallel: each table replicated; DDP all-reduces its gradients."""

    _SCALE_WEIGHT_GRADIENTS = False

    def _lookup_pg(self) -> dist.ProcessGroup | None:
        return self._env.process_group


POOLED_SHARDINGS: dict[str, type] = {
    ShardingType.TABLE_WISE.value: TwSparseCoreSharding,
    ShardingType.ROW_WISE.value: RwSparseCoreSharding,
    ShardingType.COLUMN_WISE.value: CwSparseCoreSharding,
    ShardingType.TABLE_ROW_WISE.value: TwRwSparseCoreSharding,
    ShardingType.DATA_PARALLEL.value: DpSparseCoreSharding,
}
"""The pooled strategy class of each sharding type available on tpu."""
