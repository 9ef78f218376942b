"""TorchRec's `EmbeddingCollection` (sequence embeddings) sharded by DMP onto `tpu`.

`EmbeddingCollectionSharder` offers what TorchRec's own EC sharder offers -- table-wise,
row-wise, column-wise (FUSED: the SparseCore kernels of `torchrec_plugin.sequence_kernels`) and
data-parallel (DENSE, trained through DDP) -- and shards with
`ShardedSparseCoreEmbeddingCollection`: TorchRec's `ShardedEmbeddingCollection` whose sequence
strategies (`torchrec.distributed.sharding.{tw,rw,cw,dp}_sequence_sharding`) keep their input and
output distribution and change only `create_lookup`. State and fused optimizer are as for the
pooled collection: ShardedTensors over the kernels' mirrors, the optimizer slots under FBGEMM's
names (`torchrec_plugin.fused_optimizer`).

SparseCore needs each FUSED table's `max_seq_len` (`torchrec_plugin.sequence_lengths`); the
sharded module checks every batch against it before distributing the ids, so a sample that is too
long fails with its feature, its length and the configured one, whichever sharding its table has.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding import EmbeddingCollectionSharder as _TorchRecECSharder
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import (
    BaseGroupedFeatureProcessor,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
)
from torchrec.distributed.sharding.cw_sequence_sharding import CwSequenceEmbeddingSharding
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_plugin.planning import index_placements
from torchrec_plugin.sharders import SparseCoreTablesMixin
from torchrec_plugin.sequence_kernels import DenseEmbedding, SparseCoreEmbedding
from torchrec_plugin.sequence_lengths import MAX_SEQ_LEN, sequence_lengths

__all__ = [
    "SEQUENCE_SHARDINGS",
    "EmbeddingCollectionSharder",
    "ShardedSparseCoreEmbeddingCollection",
    "SparseCoreSequenceLookup",
]


class SparseCoreSequenceLookup(GroupedEmbeddingsLookup):
    """TorchRec's grouped sequence lookup with SparseCore (FUSED) and dense (DENSE) kernels."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                                 device: torch.device | None,
                                 env: ShardingEnv | None = None) -> SparseCoreEmbedding | DenseEmbedding:
        if config.compute_kernel == EmbeddingComputeKernel.FUSED:
            return SparseCoreEmbedding(config, pg, device)
        if config.compute_kernel == EmbeddingComputeKernel.DENSE:
            return DenseEmbedding(config, pg, device)
        raise ValueError(
            f"tables {config.table_names()}: compute kernel {config.compute_kernel.value!r} is not available on tpu "
            f"(use {EmbeddingComputeKernel.FUSED.value!r} or {EmbeddingComputeKernel.DENSE.value!r})"
        )

    def push(self) -> None:
        """Write every SparseCore kernel's mirror into its tables (after a load or an init)."""
        for kernel in self._emb_modules:
            if isinstance(kernel, SparseCoreEmbedding):
                kernel.push()


class _SequenceLookups:
    """`create_lookup` of every strategy below: the stock arguments, our lookup."""

    def _lookup_pg(self) -> dist.ProcessGroup | None:
        return self._pg

    def create_lookup(self, device: torch.device | None = None, fused_params: dict[str, Any] | None = None,
                      feature_processor: BaseGroupedFeatureProcessor | None = None) -> SparseCoreSequenceLookup:
        if feature_processor is not None:
            raise ValueError("sequence embeddings take no feature processor")
        return SparseCoreSequenceLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._lookup_pg(),
            device=device if device is not None else self._device,
            env=self._env,
        )


class TwSparseCoreSequenceSharding(_SequenceLookups, TwSequenceEmbeddingSharding):
    """Table-wise: each table whole on one device."""


class RwSparseCoreSequenceSharding(_SequenceLookups, RwSequenceEmbeddingSharding):
    """Row-wise: each table in contiguous row blocks over every device."""


class CwSparseCoreSequenceSharding(_SequenceLookups, CwSequenceEmbeddingSharding):
    """Column-wise: each table in column blocks, each block table-wise."""


class DpSparseCoreSequenceSharding(_SequenceLookups, DpSequenceEmbeddingSharding):
    """Data-parallel: each table replicated; DDP all-reduces its gradients."""

    def _lookup_pg(self) -> dist.ProcessGroup | None:
        return self._env.process_group


SEQUENCE_SHARDINGS: dict[str, type] = {
    ShardingType.TABLE_WISE.value: TwSparseCoreSequenceSharding,
    ShardingType.ROW_WISE.value: RwSparseCoreSequenceSharding,
    ShardingType.COLUMN_WISE.value: CwSparseCoreSequenceSharding,
    ShardingType.DATA_PARALLEL.value: DpSparseCoreSequenceSharding,
}
"""The sequence strategy class of each sharding type available to EmbeddingCollections on tpu."""


class ShardedSparseCoreEmbeddingCollection(SparseCoreTablesMixin, ShardedEmbeddingCollection):
    """TorchRec's sharded EC with SparseCore lookups: every FUSED table's `max_seq_len` goes to
    its kernel in its `fused_params`, every batch is checked against it, and after every
    initialisation and load the kernels' mirrors are written into the SparseCore tables. Its state
    dict's ShardedTensors live on the gloo group beside the sharding group, as the pooled
    collection's do (`torchrec_plugin.groups`)."""

    _SPARSECORE_LOOKUP = SparseCoreSequenceLookup

    def __init__(self, module: EmbeddingCollection, table_name_to_parameter_sharding: dict[str, ParameterSharding],
                 env: ShardingEnv, fused_params: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(module, table_name_to_parameter_sharding, env, fused_params=fused_params, **kwargs)
        lengths = sequence_lengths((fused_params or {}).get(MAX_SEQ_LEN), [
            name for name, sharding in self.module_sharding_plan.items()
            if sharding.sharding_type != ShardingType.DATA_PARALLEL.value
        ])
        self._longest: dict[str, tuple[int, str]] = {}
        """Feature -> the shortest `max_seq_len` of the FUSED tables reading it, and that table."""
        for config in self._embedding_configs:
            for feature in config.feature_names if config.name in lengths else ():
                if feature not in self._longest or lengths[config.name] < self._longest[feature][0]:
                    self._longest[feature] = (lengths[config.name], config.name)
        self._adopt_sparsecore_tables()

    @classmethod
    def create_grouped_sharding_infos(cls, module: EmbeddingCollection,
                                      table_name_to_parameter_sharding: dict[str, ParameterSharding],
                                      fused_params: dict[str, Any] | None) -> dict[str, list[EmbeddingShardingInfo]]:
        """TorchRec's per-table sharding infos; a FUSED table's `fused_params` carry its own
        `max_seq_len` (an int: tables of one length share a kernel)."""
        fused_params = dict(fused_params or {})
        setting = fused_params.pop(MAX_SEQ_LEN, None)
        infos = super().create_grouped_sharding_infos(module, table_name_to_parameter_sharding, fused_params)
        for sharding_type, sharding_infos in infos.items():
            if sharding_type == ShardingType.DATA_PARALLEL.value:
                continue
            lengths = sequence_lengths(setting, [info.embedding_config.name for info in sharding_infos])
            for info in sharding_infos:
                info.fused_params[MAX_SEQ_LEN] = lengths[info.embedding_config.name]
        return infos

    @classmethod
    def create_embedding_sharding(cls, sharding_type: str, sharding_infos: list[EmbeddingShardingInfo],
                                  env: ShardingEnv, device: torch.device | None = None,
                                  qcomm_codecs_registry: dict[str, Any] | None = None):
        strategy = SEQUENCE_SHARDINGS.get(sharding_type)
        if strategy is None:
            raise ValueError(f"sharding type {sharding_type!r} is not available for an EmbeddingCollection on tpu; "
                             f"use one of {sorted(SEQUENCE_SHARDINGS)}")
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return strategy(sharding_infos=sharding_infos, env=env, device=device)
        return strategy(sharding_infos=sharding_infos, env=env, device=device,
                        qcomm_codecs_registry=qcomm_codecs_registry)

    def input_dist(self, ctx, features: KeyedJaggedTensor):
        """TorchRec's input distribution, after checking every sample against the `max_seq_len`
        of the tables that read its features."""
        if isinstance(features, KeyedJaggedTensor):
            self._check_lengths(features)
        return super().input_dist(ctx, features)

    def _check_lengths(self, features: KeyedJaggedTensor) -> None:
        if not any(key in self._longest for key in features.keys()):
            return
        per_key = torch.split(features.lengths().detach().cpu(), features.stride_per_key())
        for key, lengths in zip(features.keys(), per_key):
            if key not in self._longest or not lengths.numel():
                continue
            observed = int(lengths.max())
            configured, table = self._longest[key]
            if observed > configured:
                raise ValueError(
                    f"feature {key!r} (table {table!r}): a sample carries {observed} ids, more than max_seq_len "
                    f"{configured}, the longest sequence its SparseCore lookup is laid out for (raise max_seq_len "
                    "of the EmbeddingCollectionSharder, or shorten the sequences)"
                )



class EmbeddingCollectionSharder(_TorchRecECSharder):
    """Shards TorchRec `EmbeddingCollection`s onto tpu devices (see the module docstring).
    `max_seq_len`: the most ids one sample may carry in a feature, for every table (an int) or
    per table (`{table: int}`); FUSED tables need one, data-parallel ones do not."""

    def __init__(self, fused_params: dict[str, Any] | None = None,
                 max_seq_len: int | Mapping[str, int] | None = None,
                 qcomm_codecs_registry: dict[str, Any] | None = None) -> None:
        params = dict(fused_params or {})
        if max_seq_len is not None:
            params[MAX_SEQ_LEN] = dict(max_seq_len) if isinstance(max_seq_len, Mapping) else max_seq_len
        super().__init__(fused_params=params or None, qcomm_codecs_registry=qcomm_codecs_registry)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SEQUENCE_SHARDINGS)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """DENSE for data-parallel tables (trained through DDP), else FUSED: the SparseCore kernel."""
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return [EmbeddingComputeKernel.DENSE.value]
        return [EmbeddingComputeKernel.FUSED.value]

    def shard(self, module: EmbeddingCollection, params: dict[str, ParameterSharding], env: ShardingEnv,
              device: torch.device | None = None,
              module_fqn: str | None = None) -> ShardedSparseCoreEmbeddingCollection:
        params = copy.deepcopy(params)
        index_placements(params, get_local_size(env.world_size), env.rank, device)
        return ShardedSparseCoreEmbeddingCollection(
            module,
            params,
            env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingCollection
