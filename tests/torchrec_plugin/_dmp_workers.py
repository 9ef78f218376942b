"""What the spawned processes of the DMP tests run: a TorchRec model sharded by
`DistributedModelParallel` on `tpu` with the plugin's sharders, against the same model sharded by
TorchRec's own sharders on CPU over gloo (FBGEMM's CPU kernels, the reference), with the same
plan, initial weights and batches."""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as TorchRecEBCSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_plugin

STEPS = 10
LOCAL_WORLD_SIZE = 2
"""Ranks per stand-in host (table-row-wise shards over a host's ranks); each rank's process
drives its own single device."""
LEARNING_RATE = 0.05
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": LEARNING_RATE}),
    "adagrad": (torch.optim.Adagrad, {"lr": LEARNING_RATE, "eps": 1e-6}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": LEARNING_RATE, "eps": 1e-6}),
}


def tables() -> list[EmbeddingBagConfig]:
    sizes, dims = (64, 200, 96, 128), (8, 16, 8, 16)
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=v, embedding_dim=d, feature_names=[f"f{i}"],
                           pooling=PoolingType.SUM)
        for i, (v, d) in enumerate(zip(sizes, dims))
    ]


def plans(world: int) -> dict[str, dict]:
    """Per-table sharding generators: one plan per sharding type, and a mixed one."""
    names = [t.name for t in tables()]
    every = {
        "table_wise": {name: table_wise(rank=i % world) for i, name in enumerate(names)},
        "row_wise": {name: row_wise() for name in names},
        "column_wise": {name: column_wise(ranks=[(i + k) % world for k in range(2)]) for i, name in enumerate(names)},
        "table_row_wise": {name: table_row_wise(host_index=0) for name in names},
        "data_parallel": {name: data_parallel() for name in names},
    }
    every["mixed"] = {
        "t0": table_wise(rank=world - 1), "t1": row_wise(), "t2": column_wise(ranks=[0, world - 1]),
        "t3": data_parallel(),
    }
    return every


def random_batches(rng: np.random.Generator, world: int, batch: int, count: int) -> list[KeyedJaggedTensor]:
    out = []
    for _ in range(count):
        lengths = rng.integers(0, 4, size=(4, world * batch))
        values = [rng.integers(0, t.num_embeddings, size=int(lengths[i].sum())) for i, t in enumerate(tables())]
        out.append((lengths, values))
    return out


def local_kjt(lengths: np.ndarray, values: list[np.ndarray], rank: int, batch: int) -> KeyedJaggedTensor:
    rows = slice(rank * batch, (rank + 1) * batch)
    local_values, local_lengths = [], []
    for key, ids in enumerate(values):
        starts = np.concatenate([[0], np.cumsum(lengths[key])])
        local_values.append(ids[starts[rows.start]: starts[rows.stop]])
        local_lengths.append(lengths[key, rows])
    return KeyedJaggedTensor(
        keys=[t.feature_names[0] for t in tables()],
        values=torch.from_numpy(np.concatenate(local_values).astype(np.int64)),
        lengths=torch.from_numpy(np.concatenate(local_lengths).astype(np.int64)),
    )


def _plans(module: EmbeddingBagCollection, generators: dict, sharder, world: int) -> tuple[ShardingPlan, ShardingPlan]:
    """The plan on tpu, and the same plan on cpu for the reference (TorchRec's own cpu plan
    helpers place every shard on rank 0)."""
    tpu = construct_module_sharding_plan(module, generators, sharder=sharder, local_size=LOCAL_WORLD_SIZE, world_size=world,
                                         device_type="tpu")
    cpu = copy.deepcopy(tpu)
    for sharding in cpu.values():
        if sharding.sharding_spec is not None:
            for shard in sharding.sharding_spec.shards:
                shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")
    return ShardingPlan({"": tpu}), ShardingPlan({"": cpu})


def init_tpu_dist() -> None:
    """`init_process_group("cpu:gloo,tpu:tpu_dist")`, and a name for the default group.

    Works around a torchtpu bug: the default `tpu_dist` group registers no C++ backend, so its
    `group_name` raises "ProcessGroup name not set", which `ShardingEnv` (its DeviceMesh) reads."""
    from torch.distributed import distributed_c10d

    from torchtpu.distributed import ProcessGroupTPU

    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    if "group_name" not in vars(ProcessGroupTPU):
        ProcessGroupTPU.group_name = property(lambda pg: distributed_c10d._world.pg_names[pg])


def compare_with_torchrec(rank: int, world: int, batch: int, cases: tuple[tuple[str, str], ...]) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=str(LOCAL_WORLD_SIZE), LOCAL_RANK=str(rank % LOCAL_WORLD_SIZE))
    init_tpu_dist()
    gloo = dist.new_group(backend="gloo")
    for plan_name, optimizer in cases:
        _compare(rank, world, batch, plan_name, optimizer, gloo)
    dist.destroy_process_group()


def _compare(rank: int, world: int, batch: int, plan_name: str, optimizer: str, gloo) -> None:
    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(tables(), device=torch.device("cpu"))
    optimizer_class, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(optimizer_class, ebc.embedding_bags.parameters(), dict(kwargs))
    initial = {k: v.clone() for k, v in ebc.state_dict().items()}
    sharders = torchrec_plugin.sharders()
    tpu_plan, cpu_plan = _plans(ebc, plans(world)[plan_name], sharders[0], world)
    reference = DistributedModelParallel(
        copy.deepcopy(ebc), device=torch.device("cpu"), env=ShardingEnv.from_process_group(gloo), plan=cpu_plan,
        sharders=[TorchRecEBCSharder()],
    )
    tpu = DistributedModelParallel(
        copy.deepcopy(ebc), device=torch.device("tpu", 0), env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=tpu_plan, sharders=sharders,
    )
    reference.load_state_dict(initial)
    tpu.load_state_dict(initial)
    rng = np.random.default_rng(7)
    head = torch.from_numpy(rng.standard_normal((batch, 48)).astype(np.float32))
    dense_params = [p for p in tpu.parameters() if not hasattr(p, "_in_backward_optimizers")]
    dense_ref = [p for p in reference.parameters() if not hasattr(p, "_in_backward_optimizers")]
    for step, (lengths, values) in enumerate(random_batches(rng, world, batch, STEPS)):
        kjt = local_kjt(lengths, values, rank, batch)
        expected = reference(kjt).wait().to_dict()
        got = tpu(kjt.to(torch.device("tpu"))).wait().to_dict()
        for key, value in expected.items():
            torch.testing.assert_close(got[key].cpu(), value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{plan_name}/{optimizer} step {step} {key}: {m}")
        keys = sorted(expected)
        loss_ref = (torch.cat([expected[k] for k in keys], 1) * head).sum()
        loss_tpu = (torch.cat([got[k] for k in keys], 1) * head.to("tpu")).sum()
        loss_ref.backward()
        loss_tpu.backward()
        _sgd(dense_ref)
        _sgd(dense_params)
    expected_state, got_state = reference.state_dict(), tpu.state_dict()
    for key, value in expected_state.items():
        mine = got_state[key]
        if hasattr(value, "local_shards"):
            for a, b in zip(value.local_shards(), mine.local_shards()):
                torch.testing.assert_close(b.tensor.cpu(), a.tensor, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{plan_name}/{optimizer} {key}: {m}")
        else:
            torch.testing.assert_close(mine.cpu(), value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{plan_name}/{optimizer} {key}: {m}")
    print(f"rank {rank}: {plan_name}/{optimizer} ok", flush=True)


def _sgd(params: list[torch.Tensor]) -> None:
    """The data-parallel tables' dense optimizer."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= LEARNING_RATE * p.grad
                p.grad = None
