"""Module sharders for `DistributedModelParallel` on `tpu`.

`EmbeddingBagCollectionSharder` offers every sharding type the planner may choose on tpu --
table-wise, row-wise, column-wise, table-row-wise (FUSED: the SparseCore kernels) and
data-parallel (DENSE) -- and shards with `ShardedSparseCoreEmbeddingBagCollection`: TorchRec's
`ShardedEmbeddingBagCollection` whose strategies build SparseCore lookups
(`torchrec_plugin.sharding`). Its state (`state_dict`, `load_state_dict`, DCP) is TorchRec's:
ShardedTensors over the kernels' mirrors, kept in step with the SparseCore tables (see
`torchrec_plugin.kernels`), and its `fused_optimizer` holds the tables' optimizer state in
TorchRec's layout (`torchrec_plugin.fused_optimizer`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as _TorchRecEBCSharder
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_plugin.groups import host_group
from torchrec_plugin.planning import index_placements
from torchrec_plugin.sharding import POOLED_SHARDINGS, SparseCorePooledLookup

__all__ = ["EmbeddingBagCollectionSharder", "ShardedSparseCoreEmbeddingBagCollection", "TPU_SHARDING_TYPES"]

TPU_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)


def _compute_kernels(sharding_type: str) -> list[str]:
    """DENSE for data-parallel tables (trained through DDP), else FUSED: the SparseCore kernel."""
    if sharding_type == ShardingType.DATA_PARALLEL.value:
        return [EmbeddingComputeKernel.DENSE.value]
    return [EmbeddingComputeKernel.FUSED.value]


class SparseCoreTablesMixin:
    """What the sharded collections with SparseCore lookups share (listed before TorchRec's
    sharded module class): their state dict's ShardedTensors live on the gloo group beside the
    sharding group (`torchrec_plugin.groups`), so that DCP can load into a table with no shard on
    this rank; after every initialisation and load the kernels' mirrors are written into the
    SparseCore tables (`push`). `_SPARSECORE_LOOKUP`: the lookup class whose kernels hold them."""

    _SPARSECORE_LOOKUP: type

    def _adopt_sparsecore_tables(self) -> None:
        group = host_group(self._env.process_group)
        tensors = self._model_parallel_name_to_sharded_tensor
        for name, tensor in tensors.items():
            tensors[name] = ShardedTensor._init_from_local_shards_and_global_metadata(
                tensor.local_shards(), tensor.metadata(), process_group=group
            )
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.push())
        self.push()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.push()

    def push(self) -> None:
        """Mirrors -> SparseCore tables, for every lookup."""
        for lookup in self._lookups:
            lookup = getattr(lookup, "module", lookup)
            if isinstance(lookup, self._SPARSECORE_LOOKUP):
                lookup.push()


class ShardedSparseCoreEmbeddingBagCollection(SparseCoreTablesMixin, ShardedEmbeddingBagCollection):
    """TorchRec's sharded EBC with SparseCore lookups; after every initialisation and load the
    kernels' mirrors are written into the SparseCore tables. The ShardedTensors of its state dict
    live on the gloo group beside the sharding group (`torchrec_plugin.groups`), so that DCP can
    load into a table that has no shard on this rank."""

    _SPARSECORE_LOOKUP = SparseCorePooledLookup

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._adopt_sparsecore_tables()

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos, env: ShardingEnv, device: torch.device | None = None,
                                      permute_embeddings: bool = False, qcomm_codecs_registry=None):
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        strategy = POOLED_SHARDINGS.get(sharding_type)
        if strategy is None:
            raise ValueError(f"sharding type {sharding_type!r} is not available on tpu; use one of {TPU_SHARDING_TYPES}")
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return strategy(sharding_infos, env, device)
        if sharding_type == ShardingType.COLUMN_WISE.value:
            return strategy(sharding_infos, env, device, permute_embeddings=permute_embeddings,
                            qcomm_codecs_registry=qcomm_codecs_registry)
        return strategy(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)



class EmbeddingBagCollectionSharder(_TorchRecEBCSharder):
    """Shards TorchRec `EmbeddingBagCollection`s onto tpu devices (see the module docstring)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(TPU_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return _compute_kernels(sharding_type)

    def shard(self, module: EmbeddingBagCollection, params: dict[str, ParameterSharding], env: ShardingEnv,
              device: torch.device | None = None, module_fqn: str | None = None) -> ShardedSparseCoreEmbeddingBagCollection:
        params = copy.deepcopy(params)
        index_placements(params, get_local_size(env.world_size), env.rank, device)
        return ShardedSparseCoreEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )

    @property
    def module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection
