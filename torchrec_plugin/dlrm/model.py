"""The DLRM-DCN being trained: TorchRec's `DLRM_DCN` with its tables as fused SparseCore tables.

`build(config)` gives a `DLRMTraining`: TorchRec's unchanged `DLRM_DCN` whose
`EmbeddingBagCollection` is a `SparseCoreEmbeddingBagCollection` (every table MOD-sharded over all
SparseCores of every tpu device, (row-wise) Adagrad applied inside the backward), its dense layers on `tpu`
with `torch.optim.Adagrad`, and the host preparation a prefetching loader runs ahead of each step.

`reference(training)` builds the same model for plain TorchRec on CPU -- its own
`EmbeddingBagCollection` with the same optimizer applied in the backward, the same dense layers and
optimizer -- from the same initial weights: the numerical reference of the training job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings import SparseCoreBatch, SparseCoreEmbeddingBagCollection, SparseCoreEmbeddingConfig, runtime_topology
from sparsecore.optimizers import Adagrad, RowWiseAdagrad
from sparsecore.topology import Topology
from torchrec_plugin.dlrm.config import DLRMConfig

__all__ = [
    "SPARSE_PREFIX",
    "DLRMTraining",
    "PreparedBatch",
    "apply_table_optimizer",
    "build",
    "dense_optimizer",
    "dense_parameters",
    "dlrm_dcn",
    "embedding_bag_configs",
    "reference",
]

SPARSE_PREFIX = "sparse_arch.embedding_bag_collection."
"""Where `DLRM_DCN` keeps its embedding collection (the tables' names in its state dict)."""


@dataclass(frozen=True)
class PreparedBatch:
    """A batch ready for the step: dense features and labels on `tpu`, sparse features
    preprocessed into the SparseCore buffers (or, for the DMP-sharded model, the KJT on `tpu`)."""

    dense: torch.Tensor
    sparse: SparseCoreBatch | KeyedJaggedTensor
    labels: torch.Tensor


@dataclass
class DLRMTraining:
    """The model, its tables (the `SparseCoreEmbeddingBagCollection` of `build`; None when the
    plugin's DMP holds them, see `planned`), the optimizer of its dense layers, and how a batch's
    sparse features are made ready for the model (`prepare_sparse`)."""

    config: DLRMConfig
    model: nn.Module
    tables: SparseCoreEmbeddingBagCollection | None
    dense_optimizer: torch.optim.Optimizer
    prepare_sparse: Callable[[KeyedJaggedTensor], Any]
    tables_average_processes: bool = False
    """True when the tables average their gradient over processes (TorchRec's sharded modules
    divide it by the world size); the SparseCore collection sums every process's gradient."""

    def prepare(self, batch: Batch) -> PreparedBatch:
        """Host preprocessing of one batch and its transfer to the device (what the prefetching
        loader runs on its worker thread)."""
        return PreparedBatch(
            dense=batch.dense_features.to("tpu"),
            sparse=self.prepare_sparse(batch.sparse_features),
            labels=batch.labels.to(torch.float32).to("tpu"),
        )

    def dense_parameters(self) -> dict[str, nn.Parameter]:
        return dense_parameters(self.model)


def embedding_bag_configs(config: DLRMConfig) -> list[EmbeddingBagConfig]:
    """One table per sparse feature, named `t_<feature>` (TorchRec's DLRM convention)."""
    return [
        EmbeddingBagConfig(name=f"t_{feature}", embedding_dim=config.embedding_dim, num_embeddings=rows,
                           feature_names=[feature])
        for feature, rows in zip(config.feature_names, config.num_embeddings)
    ]


def sparsecore_tables(config: DLRMConfig, topology: Topology) -> list[SparseCoreEmbeddingConfig]:
    """The tables with SparseCore limits that no batch of the configured multi-hot sizes can pass:
    one SparseCore's samples send at most `samples x hot` ids to a partition, and at most the
    partition's rows, `ceil(rows / SparseCores)`, distinct ones."""
    global_batch = config.batch_size * topology.num_hosts
    samples_per_sparsecore = math.ceil(global_batch / topology.num_sparsecores)
    tables = []
    for table, hot in zip(embedding_bag_configs(config), config.multi_hot_sizes):
        ids = samples_per_sparsecore * hot
        unique = min(ids, math.ceil(table.num_embeddings / topology.num_sparsecores))
        tables.append(SparseCoreEmbeddingConfig(table, max_ids_per_partition=ids, max_unique_ids_per_partition=unique))
    return tables


def build(config: DLRMConfig, seed: int = 0) -> DLRMTraining:
    """The training model on `tpu`: tables initialised from `seed` on the device, dense layers
    from `torch.manual_seed(seed)`."""
    topology = runtime_topology()
    spec = RowWiseAdagrad if config.table_optimizer == "rowwise_adagrad" else Adagrad
    optimizer = spec(learning_rate=config.embedding_learning_rate, epsilon=config.epsilon)
    tables = SparseCoreEmbeddingBagCollection(
        sparsecore_tables(config, topology), batch_size=config.batch_size, optimizer=optimizer, topology=topology,
        seed=seed,
    )
    model = dlrm_dcn(config, tables, torch.device("tpu"), seed).to("tpu")
    optimizer = dense_optimizer(config, dense_parameters(model).values())
    return DLRMTraining(config, model, tables, optimizer, prepare_sparse=tables.prepare)


def reference(training: DLRMTraining) -> tuple[DLRM_DCN, torch.optim.Optimizer]:
    """Plain TorchRec on CPU with `training`'s current weights: `EmbeddingBagCollection` with
    the table optimizer in the backward, the same dense layers, `torch.optim.Adagrad` for them."""
    config = training.config
    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(config), device=torch.device("cpu"))
    model = dlrm_dcn(config, ebc, torch.device("cpu"), seed=0)
    model.load_state_dict({key: value.detach().cpu() for key, value in training.model.state_dict().items()})
    apply_table_optimizer(config, ebc)
    return model, dense_optimizer(config, dense_parameters(model).values())


def apply_table_optimizer(config: DLRMConfig, module: nn.Module) -> None:
    """Mark `module`'s tables for TorchRec's fused optimizer of `config` (applied in the
    backward): torch's Adagrad, or TorchRec's RowWiseAdagrad."""
    optimizer = TorchRecRowWiseAdagrad if config.table_optimizer == "rowwise_adagrad" else torch.optim.Adagrad
    apply_optimizer_in_backward(optimizer, module.parameters(),
                                {"lr": config.embedding_learning_rate, "eps": config.epsilon})


def dense_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters outside the embedding collection (trained by the dense optimizer)."""
    return {name: p for name, p in model.named_parameters() if not name.startswith(SPARSE_PREFIX)}


def dlrm_dcn(config: DLRMConfig, ebc: nn.Module, device: torch.device, seed: int) -> DLRM_DCN:
    """TorchRec's DLRM_DCN over `ebc`, dense layers on `device` from `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=config.num_dense_features,
        dense_arch_layer_sizes=list(config.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(config.over_arch_layer_sizes),
        dcn_num_layers=config.dcn_num_layers,
        dcn_low_rank_dim=config.dcn_low_rank_dim,
        dense_device=device,
    )


def dense_optimizer(config: DLRMConfig, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(list(parameters), lr=config.dense_learning_rate, eps=config.epsilon)
