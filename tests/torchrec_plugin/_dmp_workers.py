"""What the spawned processes of the DMP tests run: a TorchRec model sharded by
`DistributedModelParallel` on `tpu` with the plugin's sharders, against the same model sharded by
TorchRec's own sharders on CPU over gloo (FBGEMM's CPU kernels, the reference), with the same
plan, initial weights and batches: forward outputs, tables and fused-optimizer state; distributed
checkpoints of both (`torch.distributed.checkpoint`); and `TrainPipelineSparseDist` driving the
tpu model."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.remote_device import _remote_device
from torchrec.datasets.utils import Batch
from torchrec.distributed import comm as torchrec_comm
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
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_plugin

STEPS = 10
RESUMED_STEPS = 3
PIPELINE_STEPS = 4
LOCAL_WORLD_SIZE = 2
"""Ranks per stand-in host (table-row-wise shards over a host's ranks); each rank's process
drives its own single device."""
LEARNING_RATE = 0.05
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": LEARNING_RATE}),
    "adagrad": (torch.optim.Adagrad, {"lr": LEARNING_RATE, "eps": 1e-6}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": LEARNING_RATE, "eps": 1e-6}),
}
CPU, TPU = torch.device("cpu"), torch.device("tpu", 0)


def tables() -> list[EmbeddingBagConfig]:
    """Five tables, one per sharding type of the mixed plan; t2, which it splits by columns, into
    shards of 8 columns. Narrower shards are padded to 8 columns on SparseCore, where a row-wise
    optimizer is refused (its slot would average over the padding; `sparsecore.layout`)."""
    sizes, dims = (64, 200, 96, 128, 160), (8, 16, 16, 16, 16)
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=v, embedding_dim=d, feature_names=[f"f{i}"],
                           pooling=PoolingType.SUM)
        for i, (v, d) in enumerate(zip(sizes, dims))
    ]


def plans(world: int) -> dict[str, dict]:
    """Per-table sharding generators: one plan per sharding type (column-wise in shards of 8
    columns, SparseCore's padded width), and a mixed one holding every type -- t0 table-wise, t1 row-wise, t2 column-wise, t3 data-parallel, t4 table-row-wise on the
    last host (at four ranks the other host's ranks send it their ids)."""
    names = [t.name for t in tables()]
    every = {
        "table_wise": {name: table_wise(rank=i % world) for i, name in enumerate(names)},
        "row_wise": {name: row_wise() for name in names},
        "column_wise": {t.name: column_wise(ranks=[(i + k) % world for k in range(t.embedding_dim // 8)])
                        for i, t in enumerate(tables())},
        "table_row_wise": {name: table_row_wise(host_index=0) for name in names},
        "data_parallel": {name: data_parallel() for name in names},
    }
    every["mixed"] = {
        "t0": table_wise(rank=world - 1), "t1": row_wise(), "t2": column_wise(ranks=[0, world - 1]),
        "t3": data_parallel(), "t4": table_row_wise(host_index=world // LOCAL_WORLD_SIZE - 1),
    }
    return every


def _width() -> int:
    """Columns of all tables' pooled outputs side by side."""
    return sum(t.embedding_dim for t in tables())


def random_batches(rng: np.random.Generator, world: int, batch: int, count: int) -> list[KeyedJaggedTensor]:
    out = []
    for _ in range(count):
        lengths = rng.integers(0, 4, size=(len(tables()), world * batch))
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


def _ebc(seed: int, optimizer: str) -> EmbeddingBagCollection:
    """The tables initialised from `seed` and marked for the fused `optimizer`. Each model gets
    its own: `apply_optimizer_in_backward` marks the parameters, and a deep copy drops the mark."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables(), device=CPU)
    optimizer_class, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(optimizer_class, ebc.embedding_bags.parameters(), dict(kwargs))
    return ebc


def _plans(module: EmbeddingBagCollection, generators: dict, world: int,
           path: str = "") -> tuple[ShardingPlan, ShardingPlan]:
    """The plan on tpu, and the same plan on cpu for the reference (TorchRec's own cpu plan
    helpers place every shard on rank 0)."""
    tpu = construct_module_sharding_plan(module, generators, sharder=torchrec_plugin.sharders()[0],
                                         local_size=LOCAL_WORLD_SIZE, world_size=world, device_type="tpu")
    cpu = copy.deepcopy(tpu)
    for sharding in cpu.values():
        if sharding.sharding_spec is not None:
            for shard in sharding.sharding_spec.shards:
                shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")
    return ShardingPlan({path: tpu}), ShardingPlan({path: cpu})


def _shard(module: nn.Module, plan: ShardingPlan, device: torch.device, gloo: dist.ProcessGroup,
           **kwargs) -> DistributedModelParallel:
    """`module` sharded by the plugin on tpu, or by TorchRec on cpu over `gloo`."""
    with _table_row_wise_subgroups(device):
        if device.type == "tpu":
            return DistributedModelParallel(module, device=device, plan=plan, sharders=torchrec_plugin.sharders(),
                                            env=ShardingEnv.from_process_group(dist.group.WORLD), **kwargs)
        return DistributedModelParallel(module, device=device, env=ShardingEnv.from_process_group(gloo), plan=plan,
                                        sharders=[TorchRecEBCSharder()], **kwargs)


_SUBGROUPS: dict[str, tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]] = {}
"""The table-row-wise subgroups (intra-host, cross-host) of each device type's models."""


@contextlib.contextmanager
def _table_row_wise_subgroups(device: torch.device) -> Iterator[None]:
    """TorchRec makes the intra- and cross-host subgroups of table-row-wise sharding once per
    process, with the backend of the first caller's group (`torchrec.distributed.comm`'s
    `intra_and_cross_node_pg`). These processes hold two stacks -- the tpu models on the default
    group (`tpu_dist`, gloo for cpu tensors), TorchRec's reference on a gloo group -- so the models
    of each device type get their own pair."""
    torchrec_comm._INTRA_PG, torchrec_comm._CROSS_PG = _SUBGROUPS.get(device.type, (None, None))
    try:
        yield
    finally:
        _SUBGROUPS[device.type] = torchrec_comm._INTRA_PG, torchrec_comm._CROSS_PG


def init_tpu_dist() -> None:
    """`init_process_group("cpu:gloo,tpu:tpu_dist")`: gloo for cpu tensors, `tpu_dist` for tpu."""
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")


def _start(rank: int) -> dist.ProcessGroup:
    """torch.distributed for a rank, and a gloo group: TorchRec's CPU reference runs on it, and
    DCP coordinates over it (`tpu_dist` serves no `gather` of cpu tensors, which DCP calls)."""
    os.environ.update(LOCAL_WORLD_SIZE=str(LOCAL_WORLD_SIZE), LOCAL_RANK=str(rank % LOCAL_WORLD_SIZE))
    init_tpu_dist()
    return dist.new_group(backend="gloo")


def compare_with_torchrec(rank: int, world: int, batch: int, cases: tuple[tuple[str, str], ...],
                          checkpoint: str | None = None) -> None:
    """Each (plan, optimizer) case on tpu against TorchRec on CPU; with `checkpoint`, the last
    case's tpu model is saved there, restored into a model built from other weights (bit-exact)
    and both train on identically; then `TrainPipelineSparseDist` drives a tpu model."""
    gloo = _start(rank)
    for plan_name, optimizer in cases:
        tpu, _ = _compare(rank, world, batch, plan_name, optimizer, gloo)
    if checkpoint is not None:
        _resume_in_place(tpu, rank, world, batch, plan_name, optimizer, gloo, checkpoint)
        _pipeline_against_torchrec(rank, world, batch, gloo)
    dist.destroy_process_group()


def resume_on_another_world_size(rank: int, world: int, batch: int, checkpoint: str) -> None:
    """Load a checkpoint that another world size wrote (mixed plan, row-wise Adagrad) into a tpu
    model and into TorchRec's CPU model of this world size, both built from other weights: they
    hold the same state bit for bit, and after `STEPS` more steps the same outputs, tables and
    optimizer state (within 1e-5)."""
    gloo = _start(rank)
    tpu, reference = _models(world, "mixed", "rowwise_adagrad", gloo, seed=11)
    _load(tpu, checkpoint, gloo)
    _load(reference, checkpoint, gloo)
    _assert_states(_state(tpu), _state(reference), exact=True, label=f"loaded at world size {world}")
    _train_and_compare(tpu, reference, rank, world, batch, STEPS, "resumed/rowwise_adagrad")
    _assert_states(_state(tpu), _state(reference), exact=False, label=f"resumed at world size {world}")
    print(f"rank {rank}: resumed at world size {world} ok", flush=True)
    dist.destroy_process_group()


def _models(world: int, plan_name: str, optimizer: str, gloo: dist.ProcessGroup,
            seed: int = 3) -> tuple[DistributedModelParallel, DistributedModelParallel]:
    """The same tables (from `seed`) sharded by the same plan: on tpu, and by TorchRec on CPU."""
    initial = _ebc(seed, optimizer).state_dict()
    tpu_plan, cpu_plan = _plans(_ebc(seed, optimizer), plans(world)[plan_name], world)
    reference = _shard(_ebc(seed, optimizer), cpu_plan, CPU, gloo)
    tpu = _shard(_ebc(seed, optimizer), tpu_plan, TPU, gloo)
    reference.load_state_dict(initial)
    tpu.load_state_dict(initial)
    return tpu, reference


def _compare(rank: int, world: int, batch: int, plan_name: str, optimizer: str,
             gloo: dist.ProcessGroup) -> tuple[DistributedModelParallel, DistributedModelParallel]:
    label = f"{plan_name}/{optimizer}"
    tpu, reference = _models(world, plan_name, optimizer, gloo)
    _train_and_compare(tpu, reference, rank, world, batch, STEPS, label)
    _assert_states(_state(tpu), _state(reference), exact=False, label=label)
    print(f"rank {rank}: {label} ok", flush=True)
    return tpu, reference


def _train_and_compare(tpu: DistributedModelParallel, reference: DistributedModelParallel, rank: int, world: int,
                       batch: int, steps: int, label: str, exact: bool = False,
                       reference_device: torch.device = CPU) -> None:
    """`steps` steps of both models on the same batches; their forward outputs agree (within
    1e-5, or bit for bit)."""
    rng = np.random.default_rng(7)
    head = torch.from_numpy(rng.standard_normal((batch, _width())).astype(np.float32))
    for step, (lengths, values) in enumerate(random_batches(rng, world, batch, steps)):
        kjt = local_kjt(lengths, values, rank, batch)
        expected = _step(reference, kjt, head, reference_device)
        got = _step(tpu, kjt, head, TPU)
        for key, value in expected.items():
            _assert_same(got[key], value, exact, f"{label} step {step} {key}")


def _step(model: DistributedModelParallel, kjt: KeyedJaggedTensor, head: torch.Tensor,
          device: torch.device) -> dict[str, torch.Tensor]:
    """Forward, the loss's backward (fused updates), then SGD on the data-parallel tables."""
    pooled = model(kjt.to(device)).wait().to_dict()
    keys = sorted(pooled)
    (torch.cat([pooled[k] for k in keys], 1) * head.to(device)).sum().backward()
    with torch.no_grad():
        for _, p in in_backward_optimizer_filter(model.named_parameters()):
            if p.grad is not None:
                p -= LEARNING_RATE * p.grad
                p.grad = None
    return {key: value.detach().cpu() for key, value in pooled.items()}


def _state(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """This rank's part of the model's and its fused optimizer's state dicts, on the host. A
    ShardedTensor contributes each local shard, keyed with its global size and the shard's
    offsets and sizes, so the comparison covers the layout too."""
    out = {}
    for key, value in model.state_dict().items():
        out.update(_local(key, value))
    for key, entries in model.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            out.update(_local(f"{key}/{name}", value))
    return out


def _local(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    if not isinstance(value, ShardedTensor):
        return {key: value.detach().cpu()}
    return {
        f"{key}{list(value.size())}@{shard.metadata.shard_offsets}+{shard.metadata.shard_sizes}":
            shard.tensor.detach().cpu()
        for shard in value.local_shards()
    }


def _assert_states(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], exact: bool, label: str) -> None:
    assert sorted(got) == sorted(expected), f"{label}: state keys differ: {sorted(got)} vs {sorted(expected)}"
    for key, value in expected.items():
        _assert_same(got[key], value, exact, f"{label} {key}")


def _assert_same(got: torch.Tensor, expected: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(got, expected), f"{what}: not bit-exact (max difference {(got - expected).abs().max()})"
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _save(model: DistributedModelParallel, path: str, gloo: dist.ProcessGroup) -> None:
    """No copy-ahead, as `torchrec_plugin` advises (a tpu device has one in-order queue)."""
    dcp.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()},
             storage_writer=dcp.FileSystemWriter(path, per_thread_copy_ahead=0), process_group=gloo)


def _load(model: DistributedModelParallel, path: str, gloo: dist.ProcessGroup) -> None:
    """TorchRec's way: DCP reads into the state dicts, which are then loaded."""
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path, process_group=gloo)
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])


def _resume_in_place(tpu: DistributedModelParallel, rank: int, world: int, batch: int, plan_name: str,
                     optimizer: str, gloo: dist.ProcessGroup, path: str) -> None:
    """Save `tpu`, restore it into a model built from other weights: the same state bit for bit,
    and the same outputs and state after more steps."""
    _save(tpu, path, gloo)
    restored, _ = _models(world, plan_name, optimizer, gloo, seed=11)
    _load(restored, path, gloo)
    _assert_states(_state(restored), _state(tpu), exact=True, label="restored")
    _train_and_compare(restored, tpu, rank, world, batch, RESUMED_STEPS, "restored", exact=True,
                       reference_device=TPU)
    _assert_states(_state(restored), _state(tpu), exact=True, label="restored after training")
    print(f"rank {rank}: checkpoint round trip ok", flush=True)


class _PipelinedModel(nn.Module):
    """What TorchRec's train pipelines drive, `forward(batch) -> (loss, output)`: the pooled
    embeddings times a fixed head, plus the dense features, give each sample's logit; BCE loss."""

    def __init__(self, ebc: EmbeddingBagCollection, head: torch.Tensor) -> None:
        super().__init__()
        self.ebc = ebc
        self.register_buffer("head", head)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features)
        features = torch.cat([pooled[t.feature_names[0]] for t in tables()], dim=1)
        logits = (features * self.head).sum(dim=1) + batch.dense_features.sum(dim=1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, loss.detach()


def _pipeline_against_torchrec(rank: int, world: int, batch: int, gloo: dist.ProcessGroup) -> None:
    """`TrainPipelineSparseDist` drives the tpu model (batches to the device, input distribution
    ahead, forward, backward, the fused and dense optimizers) on the mixed plan with Adagrad;
    TorchRec's CPU model takes the same steps one by one: same losses and state."""
    rng = np.random.default_rng(5)
    head = torch.from_numpy(rng.standard_normal(_width()).astype(np.float32))
    batches = []
    for lengths, values in random_batches(rng, world, batch, PIPELINE_STEPS):
        dense = torch.from_numpy(rng.standard_normal((world * batch, 2)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, world * batch).astype(np.float32))
        rows = slice(rank * batch, (rank + 1) * batch)
        batches.append(Batch(dense[rows], local_kjt(lengths, values, rank, batch), labels[rows]))
    initial = _PipelinedModel(_ebc(5, "adagrad"), head).state_dict()
    tpu_plan, cpu_plan = _plans(_ebc(5, "adagrad"), plans(world)["mixed"], world, path="ebc")
    models = {}
    for device, plan in ((CPU, cpu_plan), (TPU, tpu_plan)):
        model = _shard(_PipelinedModel(_ebc(5, "adagrad"), head), plan, device, gloo, init_data_parallel=False)
        model = model.to(device)
        model.load_state_dict(initial)
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.SGD(params, lr=LEARNING_RATE))
        models[device.type] = model, CombinedOptimizer([model.fused_optimizer, dense])
    reference, reference_optimizer = models["cpu"]
    expected = []
    for item in batches:
        reference_optimizer.zero_grad()
        loss, _ = reference(item)
        loss.backward()
        reference_optimizer.step()
        expected.append(loss.detach())
    tpu, tpu_optimizer = models["tpu"]
    pipeline = TrainPipelineSparseDist(tpu, tpu_optimizer, TPU)
    batch_iterator = iter(batches)
    got = [pipeline.progress(batch_iterator).cpu() for _ in batches]
    for step, (a, b) in enumerate(zip(got, expected)):
        _assert_same(a, b, exact=False, what=f"pipeline step {step} loss")
    _assert_states(_state(tpu), _state(reference), exact=False, label="pipeline")
    print(f"rank {rank}: TrainPipelineSparseDist ok", flush=True)
