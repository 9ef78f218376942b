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
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings import SparseCoreEmbeddingCollection, SparseCoreEmbeddingConfig, runtime_topology
from torchrec_plugin.fused_optimizer import LocalTable, ShardOptimizer
from torchrec_plugin.kernels import _ShardTables, sparsecore_optimizer
from torchrec_plugin.sequence_lengths import MAX_SEQ_LEN

__all__ = ["DenseEmbedding", "SparseCoreEmbedding"]

class SparseCoreEmbedding(_ShardTables, BaseEmbedding, FusedOptimizerModule):
    """The unpooled lookup of a FUSED group on the SparseCores of this process's device, with the
    fused optimizer of `config.fused_params` applied in the backward (see the module docstring)."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                 device: torch.device | None) -> None:
        super().__init__(config, pg, device, requires_grad=False)
        fused_params = dict(config.fused_params or {})
        max_seq_len = fused_params.pop(MAX_SEQ_LEN, None)
        if max_seq_len is None:
            raise ValueError(f"tables {config.table_names()}: fused_params carry no {MAX_SEQ_LEN!r} (shard the "
                             "EmbeddingCollection with torchrec_plugin's EmbeddingCollectionSharder)")
        tables = config.embedding_tables
        self._keys: list[str] = []
        sequence_configs = []
        for index, table in enumerate(tables):
            keys = [f"{feature}#{len(self._keys) + k}" for k, feature in enumerate(table.feature_names)]
            self._keys.extend(keys)
            sequence_configs.append(SparseCoreEmbeddingConfig(
                EmbeddingConfig(name=f"{table.name}#{index}", num_embeddings=table.local_rows,
                                embedding_dim=table.local_cols, feature_names=keys),
                max_seq_len=max_seq_len,
            ))
        self._table_keys = [f"embeddings.{c.name}.weight" for c in sequence_configs]
        # Held outside the module tree: TorchRec collects (and re-keys) the fused optimizer of
        # every FusedOptimizerModule below a lookup, and the kernel's own presents the tables.
        self.__dict__["_collection"] = SparseCoreEmbeddingCollection(
            sequence_configs,
            batch_size=runtime_topology().num_sparsecores,
            optimizer=sparsecore_optimizer(fused_params),
        )
        weights = dict(super().named_parameters_by_table())
        self._optimizer = ShardOptimizer(self._collection, [
            LocalTable(tables[i].name, weights[tables[i].name], tuple(
                (tables[k], sequence_configs[k].name) for k in range(i, j)
            ))
            for i, j in self.table_runs()
        ], pg)

    @property
    def collection(self) -> SparseCoreEmbeddingCollection:
        return self._collection

    @property
    def fused_optimizer(self) -> ShardOptimizer:
        return self._optimizer

    def named_parameters_by_table(self) -> Iterator[tuple[str, TableBatchedEmbeddingSlice]]:
        """The tables' slices, marked as trained by the fused optimizer (TorchRec's convention,
        so that dense optimizers leave them alone)."""
        for name, weight in super().named_parameters_by_table():
            weight._in_backward_optimizers = [self._optimizer]
            yield name, weight

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        if features.variable_stride_per_key():
            raise ValueError("SparseCore lookups need one batch size for every feature (no variable batch)")
        stride = features.stride()
        self._collection.set_batch_size(stride)
        renamed = KeyedJaggedTensor(keys=self._keys, values=features.values(), lengths=features.lengths(),
                                    stride=stride)
        sequences = self._collection(renamed)
        return torch.cat([sequences[key].values() for key in self._keys])

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The mirror's tables, marked as trained by the fused optimizer (TorchRec's convention)."""
        for name, weight in self.named_parameters_by_table():
            yield f"{prefix}{'.' if prefix else ''}{name}.weight", weight

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()

    def flush(self) -> None:
        """Tables -> mirror."""
        tables = self._collection.state_dict()
        with torch.no_grad():
            for key, weight in zip(self._table_keys, self.shard_weights()):
                weight.copy_(tables[key].to(weight.device))

    def push(self) -> None:
        """Mirror -> tables."""
        values = {key: weight.detach().cpu() for key, weight in zip(self._table_keys, self.shard_weights())}
        self._collection.load_state_dict(values)


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
