"""The DLRM-DCN being trained: TorchRec's `DLRM_DCN`, sharded by the plugin's planner and DMP.

`build(config, seed)` builds TorchRec's unchanged `DLRM_DCN` on CPU (tables and dense layers from
`torch.manual_seed(seed)`), marks its tables for TorchRec's fused (row-wise) Adagrad with
`apply_optimizer_in_backward`, asks `torchrec_plugin.planner` for a plan over the processes of
the default group and shards the model with `DistributedModelParallel` and the plugin's sharders:
each table's shards are looked up and updated on the SparseCores of their process's device. The
dense layers move to `tpu` and train with `torch.optim.Adagrad`.

Two choices of this job:

* tables are planned table-, row- or column-wise, not data-parallel, and DMP does not wrap the
  dense layers in DDP (`init_data_parallel=False`): the training loop all-reduces the dense
  gradients itself in one flat collective per step, as DDP would in its buckets. (DMP's default
  DDP wrap also works on tpu: `tests/torchrec_plugin/test_models.py` trains that way.)
* a batch's KJT goes to `tpu` as it is; the sharded collection's input distribution and the
  SparseCore preprocessing run inside its forward.

`reference(config, seed)` builds the same model for plain TorchRec on CPU -- its own
`EmbeddingBagCollection` with the same optimizer applied in the backward, the same dense layers
and optimizer -- from the same seed: the numerical reference of the training job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_plugin
from torchrec_plugin.dlrm.config import DLRMConfig

__all__ = [
    "SHARDING_TYPES",
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

SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value)
"""What the planner may choose for a table (see the module docstring for data-parallel)."""


@dataclass(frozen=True)
class PreparedBatch:
    """A batch ready for the step: dense features and labels on `tpu`, the KJT on the host (see
    `DLRMTraining.prepare`)."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor


@dataclass
class DLRMTraining:
    """The sharded model (its `fused_optimizer` trains the tables in the backward), the optimizer
    of its dense layers, and the device this process drives."""

    config: DLRMConfig
    model: DistributedModelParallel
    dense_optimizer: torch.optim.Optimizer
    device: torch.device

    def prepare(self, batch: Batch) -> PreparedBatch:
        """A batch's transfer to the device (what the prefetching loader runs on its worker thread).

        Dense features and labels move to the device; the KJT stays on the host. The SparseCore
        embedding modules read its ids on the host, where they are packed into the buffers the
        lookup reads (as on a TPU, whose host packs what its SparseCores read): on the device
        they would only be copied back, each step, on the training thread (3.4 ms of an 80 ms
        mlperf step here). Its per-key lengths, which TorchRec's input dist reads as Python
        ints, are summed here, off the training thread."""
        sparse = batch.sparse_features
        sparse.length_per_key()
        return PreparedBatch(
            dense=batch.dense_features.to(self.device),
            sparse=sparse,
            labels=batch.labels.to(torch.float32).to(self.device),
        )

    def dense_parameters(self) -> dict[str, nn.Parameter]:
        return dense_parameters(self.model)


def build(config: DLRMConfig, seed: int = 0, topology: str = "cpu") -> DLRMTraining:
    """The model sharded by the plugin's plan over the default group's processes (one tpu device
    each), from `seed`; `topology` names the chip preset the planner plans for ("cpu" is the
    stand-in). Every process of the default group calls it."""
    if not dist.is_initialized():
        raise RuntimeError("the training model needs torch.distributed initialised (launch.run does it)")
    group = dist.group.WORLD
    model = _cpu_model(config, seed)
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    constraints = {table.name: ParameterConstraints(sharding_types=list(SHARDING_TYPES))
                   for table in embedding_bag_configs(config)}
    planner = torchrec_plugin.planner(
        topology=torchrec_plugin.topology(topology, world_size=dist.get_world_size()),
        batch_size=config.batch_size,
        constraints=constraints,
    )
    sharders = torchrec_plugin.sharders()
    plan = planner.collective_plan(model, sharders, group)
    device = torch.device("tpu", 0)
    sharded = DistributedModelParallel(
        model, device=device, plan=plan, sharders=sharders, env=ShardingEnv.from_process_group(group),
        init_data_parallel=False,
    ).to(device)
    # Sharding a module that lives on the CPU does not copy its weights into the shards.
    sharded.load_state_dict(initial)
    return DLRMTraining(config, sharded, dense_optimizer(config, dense_parameters(sharded).values()), device)


def reference(config: DLRMConfig, seed: int = 0) -> tuple[DLRM_DCN, torch.optim.Optimizer]:
    """Plain TorchRec on CPU with the initial weights of `build(config, seed)`:
    `EmbeddingBagCollection` with the table optimizer in the backward, the same dense layers,
    `torch.optim.Adagrad` for them."""
    model = _cpu_model(config, seed)
    return model, dense_optimizer(config, dense_parameters(model).values())


def _cpu_model(config: DLRMConfig, seed: int) -> DLRM_DCN:
    """TorchRec's DLRM_DCN on CPU, tables and dense layers from `seed`, the tables marked for
    the fused optimizer."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(config), device=torch.device("cpu"))
    model = dlrm_dcn(config, ebc, torch.device("cpu"), seed)
    apply_table_optimizer(config, model.sparse_arch)
    return model


def embedding_bag_configs(config: DLRMConfig) -> list[EmbeddingBagConfig]:
    """One table per sparse feature, named `t_<feature>` (TorchRec's DLRM convention)."""
    return [
        EmbeddingBagConfig(name=f"t_{feature}", embedding_dim=config.embedding_dim, num_embeddings=rows,
                           feature_names=[feature])
        for feature, rows in zip(config.feature_names, config.num_embeddings)
    ]


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
