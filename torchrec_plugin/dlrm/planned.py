"""The DLRM-DCN sharded by the plugin: TorchRec's planner and `DistributedModelParallel` on `tpu`.

`build_planned(config)` builds the model on CPU (the same initial weights as the CPU reference
and as `model.build` with the same seed), marks the tables for TorchRec's fused (row-wise) Adagrad
with `apply_optimizer_in_backward`, asks `torchrec_plugin.planner` for a plan over the processes of
the default group, and shards the model with `DistributedModelParallel` and the plugin's
sharders: each table's shards are looked up and updated on the SparseCores of their device.

Two choices follow from what the tpu device offers today:

* tables are planned table-, row- or column-wise, not data-parallel, and DMP does not wrap the
  dense layers in DDP (`init_data_parallel=False`): DDP's backward asks the device for a
  pinned-memory allocator that torchtpu does not register. The training loop all-reduces the
  dense gradients itself (one flat collective per step), as DDP would.
* the plugin's fused optimizer exposes no state (its `state_dict()["state"]` is empty), so a
  checkpoint could not restore the tables' Adagrad accumulators: checkpoints of this path are
  refused (`model.build`'s tables checkpoint exactly).

The batch's KJT goes to `tpu` as it is; the sharded collection's input distribution and the
SparseCore preprocessing run inside its forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import torchrec_plugin
from torchrec_plugin.dlrm.config import DLRMConfig
from torchrec_plugin.dlrm.model import (
    DLRMTraining,
    apply_table_optimizer,
    dense_optimizer,
    dense_parameters,
    dlrm_dcn,
    embedding_bag_configs,
)

__all__ = ["SHARDING_TYPES", "build_planned"]

SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value)
"""What the planner may choose for a table (see the module docstring for data-parallel)."""


def build_planned(config: DLRMConfig, seed: int = 0, topology: str = "cpu") -> DLRMTraining:
    """The model sharded by the plugin's plan over the default group's processes (one tpu device
    each); `topology` names the chip preset the planner plans for ("cpu" is the stand-in)."""
    if not dist.is_initialized():
        raise RuntimeError("the planned model needs torch.distributed initialised (launch.run does it)")
    group = dist.group.WORLD
    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(config), device=torch.device("cpu"))
    model = dlrm_dcn(config, ebc, torch.device("cpu"), seed)
    apply_table_optimizer(config, model.sparse_arch)
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
    optimizer = dense_optimizer(config, dense_parameters(sharded).values())
    return DLRMTraining(config, sharded, None, optimizer, prepare_sparse=lambda kjt: kjt.to(device),
                        tables_average_processes=True)
