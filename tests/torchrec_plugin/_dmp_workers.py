"""What the spawned processes of the DMP tests run: one EmbeddingBagCollection with a table for
every sharding type and fused optimizer (`tables`, `plan`), sharded by `DistributedModelParallel`
on `tpu` with the plugin's sharders, against the same model sharded by TorchRec's own sharders
on CPU over gloo (FBGEMM's CPU kernels, the reference), with the same plan, initial weights and
batches: forward outputs, tables and fused-optimizer state; distributed checkpoints of both
(`torch.distributed.checkpoint`), restored at the same and at another world size; and
`TrainPipelineSparseDist` driving a tpu model of one table per sharding type."""

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
import torchtpu

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
SHARDING_TYPES = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise", "twrw": "table_row_wise",
                  "dp": "data_parallel"}
"""Each sharding type by the prefix of its tables' names."""
PIPELINE_OPTIMIZER = "adagrad"
"""The train pipeline's model holds the tables of this optimizer only: one per sharding type."""
CPU, TPU = torch.device("cpu"), torch.device("tpu", 0)


def tables(optimizers: tuple[str, ...] = tuple(OPTIMIZERS)) -> list[EmbeddingBagConfig]:
    """One table `<type>_<optimizer>` per sharding type (`SHARDING_TYPES`) and optimizer, of
    various sizes; the column-wise ones 12 wide, cut into shards of 4 columns, which SparseCore
    pads to 8 (the row-wise slot still averages over the shard's own 4, as FBGEMM's does)."""
    out = []
    for i, kind in enumerate(SHARDING_TYPES):
        for j, optimizer in enumerate(OPTIMIZERS):
            if optimizer not in optimizers:
                continue
            name = f"{kind}_{optimizer}"
            dim = 12 if kind == "cw" else 16 if (i + j) % 2 else 8
            out.append(EmbeddingBagConfig(name=name, num_embeddings=40 + 8 * (3 * i + j), embedding_dim=dim,
                                          feature_names=[f"f_{name}"], pooling=PoolingType.SUM))
    return out


def _optimizer(table: str) -> str:
    """The `OPTIMIZERS` key of a table of `tables`."""
    return table.split("_", 1)[1]


def plan(world: int) -> dict:
    """Every table's sharding generator, by the type its name gives: table-wise tables and
    column-wise shards on various ranks (at two ranks a rank holds two shards of a column-wise
    table), table-row-wise tables on every host in turn (at four ranks the other
    host's ranks send them their ids)."""
    hosts = world // LOCAL_WORLD_SIZE
    generators = {}
    for t in tables():
        kind, j = t.name.split("_", 1)[0], list(OPTIMIZERS).index(_optimizer(t.name))
        if kind == "tw":
            generators[t.name] = table_wise(rank=(j + 1) % world)
        elif kind == "rw":
            generators[t.name] = row_wise()
        elif kind == "cw":
            generators[t.name] = column_wise(ranks=[(j + k) % world for k in range(t.embedding_dim // 4)])
        elif kind == "twrw":
            generators[t.name] = table_row_wise(host_index=j % hosts)
        else:
            generators[t.name] = data_parallel()
    return generators


def _width(configs: list[EmbeddingBagConfig]) -> int:
    """Columns of the tables' pooled outputs side by side."""
    return sum(t.embedding_dim for t in configs)


def random_batches(rng: np.random.Generator, configs: list[EmbeddingBagConfig], world: int, batch: int,
                   count: int) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """`count` global batches of 0 to 3 ids per sample and table: lengths, and each table's ids."""
    out = []
    for _ in range(count):
        lengths = rng.integers(0, 4, size=(len(configs), world * batch))
        values = [rng.integers(0, t.num_embeddings, size=int(lengths[i].sum())) for i, t in enumerate(configs)]
        out.append((lengths, values))
    return out


def local_kjt(configs: list[EmbeddingBagConfig], lengths: np.ndarray, values: list[np.ndarray], rank: int,
              batch: int) -> KeyedJaggedTensor:
    """This rank's `batch` samples of a global batch."""
    rows = slice(rank * batch, (rank + 1) * batch)
    local_values, local_lengths = [], []
    for key, ids in enumerate(values):
        starts = np.concatenate([[0], np.cumsum(lengths[key])])
        local_values.append(ids[starts[rows.start]: starts[rows.stop]])
        local_lengths.append(lengths[key, rows])
    return KeyedJaggedTensor(
        keys=[t.feature_names[0] for t in configs],
        values=torch.from_numpy(np.concatenate(local_values).astype(np.int64)),
        lengths=torch.from_numpy(np.concatenate(local_lengths).astype(np.int64)),
    )


def _ebc(seed: int, configs: list[EmbeddingBagConfig]) -> EmbeddingBagCollection:
    """The tables initialised from `seed`, each marked for its own fused optimizer (TorchRec
    groups tables by fused parameters, so each optimizer gets kernels of its own). Each model
    gets its own: `apply_optimizer_in_backward` marks the parameters, and a deep copy drops the
    mark. TorchRec ignores the mark on data-parallel tables (DENSE kernels; their gradients stay
    in `.grad`), which both sides then step with SGD by hand (`_step`)."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(configs, device=CPU)
    for t in configs:
        optimizer_class, kwargs = OPTIMIZERS[_optimizer(t.name)]
        apply_optimizer_in_backward(optimizer_class, [ebc.embedding_bags[t.name].weight], dict(kwargs))
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
           tpu_sharders: list | None = None, **kwargs) -> DistributedModelParallel:
    """`module` sharded by the plugin on tpu (its default sharders, or `tpu_sharders`), or by
    TorchRec on cpu over `gloo`."""
    with _table_row_wise_subgroups(device):
        if device.type == "tpu":
            sharders = tpu_sharders or torchrec_plugin.sharders()
            return DistributedModelParallel(module, device=device, plan=plan, sharders=sharders,
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


def compare_with_torchrec(rank: int, world: int, batch: int, checkpoint: str) -> None:
    """The every-type plan on tpu against TorchRec on CPU (`_compare`); the tpu model is then
    saved to `checkpoint`, restored into a model built from other weights (bit-exact) and both
    train on identically; then `TrainPipelineSparseDist` drives a tpu model."""
    gloo = _start(rank)
    tpu, _ = _compare(rank, world, batch, gloo)
    _resume_in_place(tpu, rank, world, batch, gloo, checkpoint)
    _pipeline_against_torchrec(rank, world, batch, gloo)
    dist.destroy_process_group()


def compare_and_resume_on_another_world_size(rank: int, world: int, batch: int, checkpoint: str) -> None:
    """The every-type plan on tpu against TorchRec on CPU (`_compare`); then both trained models
    load a checkpoint that another world size wrote: they hold the same state bit for bit (none
    of it what they held before), and after `RESUMED_STEPS` more steps the same outputs, tables
    and optimizer state (within 1e-5)."""
    gloo = _start(rank)
    tpu, reference = _compare(rank, world, batch, gloo)
    before = _state(tpu)
    _load(tpu, checkpoint, gloo)
    _load(reference, checkpoint, gloo)
    loaded = _state(tpu)
    _assert_states(loaded, _state(reference), exact=True, label=f"loaded at world size {world}")
    unchanged = [key for key, value in loaded.items() if value.numel() and torch.equal(value, before[key])]
    assert not unchanged, f"the load left {unchanged} as they were"
    _train_and_compare(tpu, reference, rank, world, batch, RESUMED_STEPS, "resumed")
    _assert_states(_state(tpu), _state(reference), exact=False, label=f"resumed at world size {world}")
    print(f"rank {rank}: resumed at world size {world} ok", flush=True)
    dist.destroy_process_group()


def _tpu_model(world: int, gloo: dist.ProcessGroup, seed: int) -> DistributedModelParallel:
    """The every-type plan's tables (from `seed`) sharded on tpu by the plugin."""
    tpu_plan, _ = _plans(_ebc(seed, tables()), plan(world), world)
    model = _shard(_ebc(seed, tables()), tpu_plan, TPU, gloo)
    model.load_state_dict(_ebc(seed, tables()).state_dict())
    return model


def _compare(rank: int, world: int, batch: int,
             gloo: dist.ProcessGroup) -> tuple[DistributedModelParallel, DistributedModelParallel]:
    """The every-type plan's tables from the same weights, on tpu by the plugin and on CPU by
    TorchRec: `STEPS` steps, the same outputs each step, tables and optimizer state after. The
    SparseCore tables start from limits of 2 ids per partition, which the first batches exceed:
    each kernel grows its limits (a new layout) and trains on as TorchRec does."""
    initial = _ebc(3, tables()).state_dict()
    tpu_plan, cpu_plan = _plans(_ebc(3, tables()), plan(world), world)
    reference = _shard(_ebc(3, tables()), cpu_plan, CPU, gloo)
    tpu = _shard(_ebc(3, tables()), tpu_plan, TPU, gloo, tpu_sharders=torchrec_plugin.sharders(limits=(2, 2)))
    reference.load_state_dict(initial)
    tpu.load_state_dict(initial)
    label = f"every type x optimizer at world size {world}"
    growths = torchtpu.metrics().get("sparsecore_limit_growths", 0)
    _train_and_compare(tpu, reference, rank, world, batch, STEPS, label)
    _assert_states(_state(tpu), _state(reference), exact=False, label=label)
    assert torchtpu.metrics().get("sparsecore_limit_growths", 0) > growths, "no SparseCore limits grew"
    print(f"rank {rank}: {label} ok", flush=True)
    return tpu, reference


def _train_and_compare(tpu: DistributedModelParallel, reference: DistributedModelParallel, rank: int, world: int,
                       batch: int, steps: int, label: str, exact: bool = False,
                       reference_device: torch.device = CPU) -> None:
    """`steps` steps of both models on the same batches; their forward outputs agree (within
    1e-5, or bit for bit)."""
    configs = tables()
    rng = np.random.default_rng(7)
    head = torch.from_numpy(rng.standard_normal((batch, _width(configs))).astype(np.float32))
    for step, (lengths, values) in enumerate(random_batches(rng, configs, world, batch, steps)):
        kjt = local_kjt(configs, lengths, values, rank, batch)
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
    """TorchRec's way: DCP reads into the state dicts, which are then loaded. SGD tables have an
    empty optimizer state, which DCP does not save; on a rank that lacks some other table's state
    (a table-wise table elsewhere), DCP's loader then takes the empty entries for keys of an old
    checkpoint format and fails, so they are left out of what it reads."""
    model_state, optim_state = model.state_dict(), model.fused_optimizer.state_dict()
    readable = {key: value for key, value in optim_state["state"].items() if value}
    dcp.load({"model": model_state, "optim": {"state": readable}}, checkpoint_id=path, process_group=gloo)
    model.load_state_dict(model_state)
    model.fused_optimizer.load_state_dict(optim_state)


def _resume_in_place(tpu: DistributedModelParallel, rank: int, world: int, batch: int, gloo: dist.ProcessGroup,
                     path: str) -> None:
    """Save `tpu`, restore it into a model built from other weights: the same state bit for bit,
    and the same outputs and state after more steps."""
    _save(tpu, path, gloo)
    restored = _tpu_model(world, gloo, seed=11)
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
        self._keys = [config.feature_names[0] for config in ebc.embedding_bag_configs()]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features)
        features = torch.cat([pooled[key] for key in self._keys], dim=1)
        logits = (features * self.head).sum(dim=1) + batch.dense_features.sum(dim=1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, loss.detach()


def _pipeline_against_torchrec(rank: int, world: int, batch: int, gloo: dist.ProcessGroup) -> None:
    """`TrainPipelineSparseDist` drives the tpu model (batches to the device, input distribution
    ahead, forward, backward, the fused and dense optimizers) on the every-type plan's tables of
    `PIPELINE_OPTIMIZER` (one per sharding type); TorchRec's CPU model takes the same steps one
    by one: same losses and state."""
    configs = tables((PIPELINE_OPTIMIZER,))
    rng = np.random.default_rng(5)
    head = torch.from_numpy(rng.standard_normal(_width(configs)).astype(np.float32))
    batches = []
    for lengths, values in random_batches(rng, configs, world, batch, PIPELINE_STEPS):
        dense = torch.from_numpy(rng.standard_normal((world * batch, 2)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, world * batch).astype(np.float32))
        rows = slice(rank * batch, (rank + 1) * batch)
        batches.append(Batch(dense[rows], local_kjt(configs, lengths, values, rank, batch), labels[rows]))
    initial = _PipelinedModel(_ebc(5, configs), head).state_dict()
    generators = {name: generator for name, generator in plan(world).items()
                  if _optimizer(name) == PIPELINE_OPTIMIZER}
    tpu_plan, cpu_plan = _plans(_ebc(5, configs), generators, world, path="ebc")
    models = {}
    for device, sharding_plan in ((CPU, cpu_plan), (TPU, tpu_plan)):
        model = _shard(_PipelinedModel(_ebc(5, configs), head), sharding_plan, device, gloo, init_data_parallel=False)
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
