"""TorchRec's planner and `DistributedModelParallel` on `tpu`, with lookups on SparseCore.

How to use::

    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import torchrec_plugin

    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    pg = dist.group.WORLD
    topology = torchrec_plugin.topology("v5p", world_size=dist.get_world_size())  # or "v4", "v6e", "tpu7x", "cpu"
    planner = torchrec_plugin.planner(topology=topology, batch_size=B)            # a torchrec EmbeddingShardingPlanner
    sharders = torchrec_plugin.sharders(fused_params=None, max_seq_len=None)       # ModuleSharders for tpu
    plan = planner.collective_plan(model, sharders, pg)                            # planner.plan(model, sharders) in one process
    dmp = DistributedModelParallel(model, device=torch.device("tpu", local_rank), plan=plan,
                                   sharders=sharders, env=ShardingEnv.from_process_group(pg))

Fused optimizers come from `fused_params` or `apply_optimizer_in_backward` (SGD, Adagrad,
row-wise Adagrad, Adam); data-parallel tables train through DDP with the dense optimizer.
`TrainPipelineSparseDist(dmp, optimizer, torch.device("tpu", local_rank))` drives the model.

Checkpoints are TorchRec's: the model's `state_dict()` (tables as ShardedTensors) and
`dmp.fused_optimizer.state_dict()` (the tables' optimizer state, sharded as the tables are, under
FBGEMM's names: `torchrec_plugin.fused_optimizer`), saved and loaded with
`torch.distributed.checkpoint`, also onto another world size::

    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, per_thread_copy_ahead=0),
             process_group=torchrec_plugin.host_group())
    dcp.load(state, checkpoint_id=path, process_group=torchrec_plugin.host_group())
    dmp.load_state_dict(state["model"]); dmp.fused_optimizer.load_state_dict(state["optim"])

DCP coordinates over a gloo group (`host_group`: `tpu_dist` serves no `gather`), without
copy-ahead: it overlaps device-to-host copies with writing on a second stream, and a tpu device
has one in-order queue (`torch.tpu.Stream`).

Sharding types and what runs in each shard (`torchrec_plugin.sharders`):

* table-wise, row-wise, column-wise, table-row-wise: compute kernel FUSED, the SparseCore kernel.
  Within its device, every shard is MOD-sharded over the device's SparseCores (row r on
  SparseCore r mod S): that is SparseCore's native layout, and it is not a plan choice -- the
  plan decides which rows and columns a device holds (TorchRec's types), SparseCore decides how
  the device holds them.
* data-parallel: compute kernel DENSE, an `embedding_bag` on the device, gradients through DDP.

`EmbeddingCollection`s (sequence embeddings, `torchrec_plugin.sequence`) take the types TorchRec's
own EC sharder offers: table-wise, row-wise, column-wise (FUSED: one row per id, looked up on
SparseCore) and data-parallel (DENSE: `embedding` on the device, through DDP). SparseCore looks a
sequence feature up as a static `[samples, max_seq_len]` block, so their FUSED tables need the
longest sequence a sample may carry: `torchrec_plugin.sharders(max_seq_len=32)` or
`max_seq_len={table: length}`; a batch with a longer sample raises, naming the feature and both
lengths (`torchrec_plugin.sequence_lengths`).

SparseCore preprocesses ids into static buffers bounded per partition (`max_ids_per_partition`,
`max_unique_ids_per_partition`). A FUSED group starts from its tables' default limits and, on one
host, grows them when a batch needs more -- to 1.5x its need by default, a new layout and one
compile, logged and counted in `torchtpu.metrics()` as `sparsecore_limit_growths`; nothing is
dropped. `torchrec_plugin.sharders(limit_growth=None)` keeps the limits fixed: a batch over them
then raises, naming the stack, the limit, and the observed and configured values;
`sharders(limits=(max_ids, max_unique_ids))` sets where every table starts.

One process drives one tpu device. See `torchrec_plugin.hardware` for the chip presets and
`torchrec_plugin.estimators` for what the planner counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrec.distributed.types import ModuleSharder
from torch import nn

from torchtpu.ops import fbgemm as _fbgemm
from torchrec_plugin.groups import host_group
from torchrec_plugin.planning import TpuShardingPlanner, planner
from torchrec_plugin.sequence import EmbeddingCollectionSharder
from torchrec_plugin.sharders import EmbeddingBagCollectionSharder
from torchrec_plugin.hardware import TpuTopology, topology
from torchrec_plugin.kernels import DEFAULT_LIMIT_GROWTH, LIMIT_GROWTH, LIMITS, check_limits

_fbgemm.install()

__all__ = [
    "EmbeddingBagCollectionSharder", "EmbeddingCollectionSharder", "TpuShardingPlanner", "TpuTopology", "host_group",
    "planner", "sharders", "topology",
]


def sharders(fused_params: dict[str, Any] | None = None,
             max_seq_len: int | Mapping[str, int] | None = None,
             limit_growth: float | None = DEFAULT_LIMIT_GROWTH,
             limits: tuple[int, int] | None = None) -> list[ModuleSharder[nn.Module]]:
    """The sharders for `DistributedModelParallel` on tpu: TorchRec's `EmbeddingBagCollection` and
    `EmbeddingCollection`. `fused_params`: defaults of the fused optimizer (e.g. `{"optimizer":
    EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05}`); a table's `apply_optimizer_in_backward`
    settings take precedence. `max_seq_len`: the most ids a sample may carry in a feature of an
    `EmbeddingCollection`'s SparseCore tables, one int or `{table: int}` (`torchrec_plugin.sequence`).
    `limit_growth`: how the SparseCore limits grow when a batch needs more (a margin >= 1), or None
    to keep them fixed (`torchrec_plugin.kernels.DEFAULT_LIMIT_GROWTH`). `limits`: the
    `(max_ids_per_partition, max_unique_ids_per_partition)` every SparseCore table starts from
    (default: `sparsecore`'s)."""
    if limit_growth is not None and not limit_growth >= 1.0:
        raise ValueError(f"limit_growth must be a margin >= 1.0 over what a batch needs, or None, got {limit_growth}")
    fused_params = {**(fused_params or {}), LIMIT_GROWTH: limit_growth}
    checked = check_limits(limits)
    if checked is not None:
        fused_params[LIMITS] = checked
    return [EmbeddingBagCollectionSharder(fused_params=fused_params),
            EmbeddingCollectionSharder(fused_params=fused_params, max_seq_len=max_seq_len)]
