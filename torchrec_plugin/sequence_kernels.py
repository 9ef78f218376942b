"""The unpooled lookup inside one shard of a DMP-sharded `EmbeddingCollection` on `tpu`.

TorchRec's sequence kernels return one row per id, `[ids, local_cols]`, the ids in the order of
the KJT they are given. Here a FUSED group becomes a `SparseCoreEmbedding`: an
`embeddings.SparseCoreEmbeddingCollection` over the local shards of its tables (MOD-sharded over
the SparseCores of this process's device, the fused optimizer applied in the backward), with the
TorchRec-layout mirror and fused optimizer of the pooled kernel (`torchrec_plugin.kernels`). A
DENSE group (data-parallel tables) becomes a `DenseEmbedding`: `embedding` per feature on `tpu`,
gradients all-reduced by DDP.

SparseCore looks a sequence feature up as a static `[samples, max_seq_len]` block and selects
the rows of the real ids, so each FUSED table needs the longest sequence a sample may carry.
It is a setting of the sharder, carried to the kernels in the tables' `fused_params`
(`torchrec_plugin.sequence_lengths`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings import SparseCoreEmbeddingCollection, SparseCoreEmbeddingConfig, runtime_topology
from torchrec_plugin.kernels import SparseCoreKernel, _ShardTables, fused_settings
from torchrec_plugin.sequence_lengths import MAX_SEQ_LEN

__all__ = ["DenseEmbedding", "SparseCoreEmbedding"]


class SparseCoreEmbedding(SparseCoreKernel):
    """The unpooled lookup of a FUSED group on the SparseCores of this process's device, with the
    fused optimizer of `config.fused_params` applied in the backward (see the module docstring)."""

    _STATE_PREFIX = "embeddings."

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                 device: torch.device | None) -> None:
        super().__init__(config, pg, device)
        fused_params = dict(config.fused_params or {})
        max_seq_len = fused_params.pop(MAX_SEQ_LEN, None)
        if max_seq_len is None:
            raise ValueError(f"tables {config.table_names()}: fused_params carry no {MAX_SEQ_LEN!r} (shard the "
                             "EmbeddingCollection with torchrec_plugin's EmbeddingCollectionSharder)")
        settings, limits = fused_settings(fused_params)
        sequence_configs = [
            SparseCoreEmbeddingConfig(
                EmbeddingConfig(name=f"{table.name}#{index}", num_embeddings=table.local_rows,
                                embedding_dim=table.local_cols, feature_names=keys),
                max_seq_len=max_seq_len,
                **limits,
            )
            for index, (table, keys) in enumerate(zip(config.embedding_tables, self._shard_keys))
        ]
        collection = SparseCoreEmbeddingCollection(
            sequence_configs,
            batch_size=runtime_topology().num_sparsecores,
            **settings,
        )
        self._attach(collection, [c.name for c in sequence_configs], pg)

    @property
    def collection(self) -> SparseCoreEmbeddingCollection:
        return self._collection

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        sequences = self._collection(self._renamed(features, weighted=False))
        return torch.cat([sequences[key].values() for key in self._keys])


class DenseEmbedding(_ShardTables, BaseEmbedding):
    """The unpooled lookup of a DENSE group (data-parallel tables): `embedding` per feature on
    `tpu`; the tables get ordinary gradients (DDP all-reduces them, the dense optimizer steps)."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                 device: torch.device | None) -> None:
        super().__init__(config, pg, device, requires_grad=True)
        nn.init.uniform_(self._flat, -0.01, 0.01)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        ids = features.values()
        lengths = features.length_per_key()
        outputs = []
        start = key = 0
        for table, weight in zip(self._config.embedding_tables, self.shard_weights()):
            for _ in table.feature_names:
                stop = start + lengths[key]
                outputs.append(nn.functional.embedding(ids[start:stop], weight))
                start, key = stop, key + 1
        return torch.cat(outputs)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        combined = "/".join(t.name for t in self._config.embedding_tables)
        yield f"{prefix}{'.' if prefix else ''}{combined}.weight", self._flat
