"""What the spawned processes of the sequence-embedding DMP test run: a TorchRec
`EmbeddingCollection` sharded by `DistributedModelParallel` on `tpu` with the plugin's sharders,
against TorchRec on CPU over gloo with the same plan, initial weights and batches.

The reference is TorchRec's own: its DMP with its own `EmbeddingCollectionSharder` and FBGEMM's
CPU kernels for the table-wise, row-wise and column-wise tables, and for the data-parallel table
what TorchRec's data-parallel sharding is -- the table replicated, its gradients averaged by DDP --
as TorchRec's unsharded `EmbeddingCollection` under `DistributedDataParallel`. (TorchRec's own
data-parallel EC cannot run on CPU: FBGEMM's CPU dense kernel ignores `PoolingMode.NONE` and
pools.)"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.remote_device import _remote_device
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder as TorchRecECSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import torchrec_plugin
from _dmp_workers import _local  # a ShardedTensor's local shards keyed with their layout

STEPS = 5
LOCAL_WORLD_SIZE = 2
LEARNING_RATE = 0.05
DIM = 16
"""Every table's width (an EmbeddingCollection's tables share one); the column-wise table is
split into shards of 8 columns."""
MAX_SEQ_LEN = {"t0": 4, "t1": 5, "t2": 4}
"""Of the SparseCore (FUSED) tables; the batches' samples carry 0 to 4 ids per feature."""
DATA_PARALLEL = "t3"
CPU, TPU = torch.device("cpu"), torch.device("tpu", 0)


def tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f{i}"])
        for i, rows in enumerate((64, 200, 96, 128))
    ]


def generators(world: int) -> dict:
    """Table-wise, row-wise, column-wise and data-parallel tables in one plan."""
    return {"t0": table_wise(rank=world - 1), "t1": row_wise(), "t2": column_wise(ranks=[0, world - 1]),
            DATA_PARALLEL: data_parallel()}


def _collection(configs: list[EmbeddingConfig], fused: bool) -> EmbeddingCollection:
    """`configs` as an EmbeddingCollection, its tables marked for fused Adagrad when `fused`.
    Each model gets its own: a deep copy drops `apply_optimizer_in_backward`'s marks."""
    ec = EmbeddingCollection(configs, device=CPU)
    if fused:
        apply_optimizer_in_backward(torch.optim.Adagrad, ec.embeddings.parameters(), {"lr": LEARNING_RATE, "eps": 1e-6})
    return ec


def _plans(world: int) -> tuple[dict, dict]:
    """The mixed plan on tpu, and the same plan of the sharded tables on cpu for the reference."""
    sharder = torchrec_plugin.sharders(max_seq_len=MAX_SEQ_LEN)[1]
    tpu = construct_module_sharding_plan(_collection(tables(), fused=True), generators(world), sharder=sharder,
                                         local_size=LOCAL_WORLD_SIZE, world_size=world, device_type="tpu")
    cpu = {name: copy.deepcopy(sharding) for name, sharding in tpu.items() if name != DATA_PARALLEL}
    for sharding in cpu.values():
        for shard in sharding.sharding_spec.shards:
            shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")
    return tpu, cpu


def _tpu_model(plan: dict, initial: dict[str, torch.Tensor]) -> DistributedModelParallel:
    model = DistributedModelParallel(
        _collection(tables(), fused=True), device=TPU, env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"": plan}), sharders=torchrec_plugin.sharders(max_seq_len=MAX_SEQ_LEN),
    )
    model.load_state_dict(initial)
    return model


def _reference(plan: dict, initial: dict[str, torch.Tensor], gloo: dist.ProcessGroup,
               ) -> tuple[DistributedModelParallel, DistributedDataParallel]:
    """TorchRec's DMP on CPU for the sharded tables, and DDP over TorchRec's EC for the
    data-parallel one."""
    sharded = DistributedModelParallel(
        _collection([t for t in tables() if t.name != DATA_PARALLEL], fused=True), device=CPU,
        env=ShardingEnv.from_process_group(gloo), plan=ShardingPlan({"": plan}), sharders=[TorchRecECSharder()],
    )
    sharded.load_state_dict({k: v for k, v in initial.items() if DATA_PARALLEL not in k})
    replicated = _collection([t for t in tables() if t.name == DATA_PARALLEL], fused=False)
    replicated.load_state_dict({k: v for k, v in initial.items() if DATA_PARALLEL in k})
    return sharded, DistributedDataParallel(replicated, process_group=gloo)


def random_batches(rng: np.random.Generator, world: int, batch: int, count: int) -> list:
    out = []
    for _ in range(count):
        lengths = rng.integers(0, 5, size=(len(tables()), world * batch))
        values = [rng.integers(0, t.num_embeddings, size=int(lengths[i].sum())) for i, t in enumerate(tables())]
        out.append((lengths, values))
    return out


def local_kjt(lengths: np.ndarray, values: list[np.ndarray], rank: int, batch: int,
              keys: list[str] | None = None) -> KeyedJaggedTensor:
    """This rank's samples of the features `keys` (default: all)."""
    names = [t.feature_names[0] for t in tables()]
    keys = names if keys is None else keys
    rows = slice(rank * batch, (rank + 1) * batch)
    local_values, local_lengths = [], []
    for key in keys:
        i = names.index(key)
        starts = np.concatenate([[0], np.cumsum(lengths[i])])
        local_values.append(values[i][starts[rows.start]: starts[rows.stop]])
        local_lengths.append(lengths[i, rows])
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.concatenate(local_values).astype(np.int64)),
        lengths=torch.from_numpy(np.concatenate(local_lengths).astype(np.int64)),
    )


def _loss(sequences: dict[str, JaggedTensor], heads: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum((sequences[key].values() * heads[key].to(sequences[key].values().device)).sum() for key in heads)


def _dense_sgd(parameters) -> None:
    """The dense optimizer of the data-parallel table (gradients averaged by DDP)."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                p -= LEARNING_RATE * p.grad
                p.grad = None


def _state(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """This rank's part of a model's state dict and, for a DMP model, its fused optimizer's, on
    the host; a ShardedTensor contributes each local shard keyed with its layout."""
    out = {}
    for key, value in model.state_dict().items():
        out.update(_local(key.removeprefix(prefix), value))
    if isinstance(model, DistributedModelParallel):
        for key, entries in model.fused_optimizer.state_dict()["state"].items():
            for name, value in entries.items():
                out.update(_local(f"{key}/{name}", value))
    return out


def _assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def compare_with_torchrec(rank: int, world: int, batch: int) -> None:
    """`STEPS` steps of fused Adagrad on the mixed plan: each step's sequences (values and
    lengths) and then the tables and optimizer state agree with TorchRec's within 1e-5. Then a
    sample longer than its table's max_seq_len is refused before any id moves."""
    os.environ.update(LOCAL_WORLD_SIZE=str(LOCAL_WORLD_SIZE), LOCAL_RANK=str(rank % LOCAL_WORLD_SIZE))
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(3)
    initial = EmbeddingCollection(tables(), device=CPU).state_dict()
    tpu_plan, cpu_plan = _plans(world)
    tpu = _tpu_model(tpu_plan, initial)
    sharded, replicated = _reference(cpu_plan, initial, gloo)
    names = [t.feature_names[0] for t in tables()]
    rng = np.random.default_rng(7)
    for step, (lengths, values) in enumerate(random_batches(rng, world, batch, STEPS)):
        kjt = local_kjt(lengths, values, rank, batch)
        counts = kjt.length_per_key()
        heads = {key: torch.from_numpy(rng.standard_normal((n, DIM)).astype(np.float32))
                 for key, n in zip(names, counts)}
        expected = sharded(local_kjt(lengths, values, rank, batch, names[:3])).wait()
        expected.update(replicated(local_kjt(lengths, values, rank, batch, names[3:])))
        _loss(expected, heads).backward()
        _dense_sgd(replicated.parameters())
        got = tpu(kjt.to(TPU)).wait()
        _loss(got, heads).backward()
        _dense_sgd(p for _, p in in_backward_optimizer_filter(tpu.named_parameters()))
        assert sorted(got) == sorted(expected), f"step {step}: features {sorted(got)} vs {sorted(expected)}"
        for key, sequence in expected.items():
            assert torch.equal(got[key].lengths().cpu(), sequence.lengths()), f"step {step} {key}: lengths differ"
            _assert_close(got[key].values().cpu(), sequence.values().detach(), f"step {step} {key} values")
    state = _state(tpu)
    reference = {**_state(sharded), **_state(replicated, prefix="module.")}
    assert sorted(state) == sorted(reference), f"state keys differ: {sorted(state)} vs {sorted(reference)}"
    assert any("momentum1" in key for key in reference), f"no Adagrad state compared: {sorted(reference)}"
    for key, value in reference.items():
        _assert_close(state[key], value, f"after {STEPS} steps: {key}")
    print(f"rank {rank}: sequence embeddings match TorchRec", flush=True)
    _refuses_overlong_sequence(tpu, rank, batch)
    dist.destroy_process_group()


def _refuses_overlong_sequence(tpu: DistributedModelParallel, rank: int, batch: int) -> None:
    lengths = np.ones((len(tables()), batch), dtype=np.int64)
    lengths[0, batch // 2] = MAX_SEQ_LEN["t0"] + 2
    values = [np.zeros(int(row.sum()), dtype=np.int64) for row in lengths]
    kjt = local_kjt(lengths, values, 0, batch)
    try:
        tpu(kjt.to(TPU))
    except ValueError as error:
        message = str(error)
        assert "'f0'" in message and "6 ids" in message and "max_seq_len 4" in message, message
    else:
        raise AssertionError("a sequence longer than max_seq_len was accepted")
    print(f"rank {rank}: over-long sequence refused", flush=True)
