"""What the spawned processes of the sequence-embedding DMP test run: a TorchRec
`EmbeddingCollection` sharded by `DistributedModelParallel` on `tpu` with the plugin's sharders
and driven by `TrainPipelineSparseDist`, against TorchRec on CPU over gloo with the same plan,
initial weights and batches; then a distributed checkpoint of the tpu model. The DMP workers'
helpers (`_dmp_workers`: start-up, checkpoints, state comparison) serve here too.

The reference is TorchRec's own: its DMP with its own `EmbeddingCollectionSharder` and FBGEMM's
CPU kernels for the table-wise, row-wise and column-wise tables, and for the data-parallel table
what TorchRec's data-parallel sharding is -- the table replicated, its gradients averaged by DDP --
as TorchRec's unsharded `EmbeddingCollection` under `DistributedDataParallel`. (TorchRec's own
data-parallel EC cannot run on CPU: FBGEMM's CPU dense kernel ignores `PoolingMode.NONE` and
pools.)"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.remote_device import _remote_device
from torch.nn.parallel import DistributedDataParallel
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding import EmbeddingCollectionSharder as TorchRecECSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import torchrec_plugin
from _dmp_workers import (
    LEARNING_RATE,
    LOCAL_WORLD_SIZE,
    _assert_same,
    _assert_states,
    _load,
    _local,
    _save,
    _start,
)

STEPS = 5
RESUMED_STEPS = 1
"""Steps of a restored model and of the model it was saved from (the restored optimizer state
takes part in the first)."""
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


class _SequenceModel(nn.Module):
    """What TorchRec's train pipelines drive, `forward(batch) -> (loss, output)`: `_loss` of the
    collection's sequences; the output is the loss and the sequences."""

    def __init__(self, ec: EmbeddingCollection, head: torch.Tensor) -> None:
        super().__init__()
        self.ec = ec
        self.register_buffer("head", head, persistent=False)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, dict[str, JaggedTensor]]]:
        sequences = self.ec(batch.sparse_features)
        sequences = {key: sequences[key] for key in _features()}  # a sharded EC's output is awaited lazily
        loss = _loss(sequences, self.head)
        return loss, (loss.detach(), sequences)


def _loss(sequences: dict[str, JaggedTensor], head: torch.Tensor) -> torch.Tensor:
    """Each id's embedding dotted with `head` is its logit (a product and a sum: a tpu matmul is
    one bf16 pass by default); the loss sums the logits' softplus. Features are read by name:
    TorchRec's train pipeline traces this with torch.fx."""
    return sum(nn.functional.softplus((sequences[key].values() * head).sum(1)).sum() for key in _features())


def _features() -> list[str]:
    return [t.feature_names[0] for t in tables()]


def _initial(seed: int) -> dict[str, torch.Tensor]:
    """Tables initialised from `seed`, as TorchRec's EmbeddingCollection does."""
    torch.manual_seed(seed)
    return EmbeddingCollection(tables(), device=CPU).state_dict()


def _tpu_model(plan: dict, initial: dict[str, torch.Tensor], head: torch.Tensor) -> DistributedModelParallel:
    """`_SequenceModel` with the collection sharded by `plan` onto tpu, its tables from `initial`."""
    model = DistributedModelParallel(
        _SequenceModel(_collection(tables(), fused=True), head.to(TPU)), device=TPU,
        env=ShardingEnv.from_process_group(dist.group.WORLD), plan=ShardingPlan({"ec": plan}),
        sharders=torchrec_plugin.sharders(max_seq_len=MAX_SEQ_LEN),
    )
    model.load_state_dict({f"ec.{key}": value for key, value in initial.items()})
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
    names = _features()
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


def _batch(kjt: KeyedJaggedTensor, batch: int) -> Batch:
    """`kjt` as the sparse features of a train-pipeline batch (no dense features, no labels)."""
    return Batch(dense_features=torch.zeros(batch, 1), sparse_features=kjt, labels=torch.zeros(batch))


def _dense_sgd(parameters) -> None:
    """The dense optimizer of the data-parallel table (gradients averaged by DDP)."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                p -= LEARNING_RATE * p.grad
                p.grad = None


def _reference_step(sharded: DistributedModelParallel, replicated: DistributedDataParallel, lengths: np.ndarray,
                    values: list[np.ndarray], rank: int, batch: int,
                    head: torch.Tensor) -> tuple[torch.Tensor, dict[str, JaggedTensor]]:
    """A step of TorchRec's CPU model: forward of the sharded and the replicated tables, the
    loss's backward (fused updates), SGD on the replicated table. Returns the loss and sequences."""
    names = _features()
    sequences = sharded(local_kjt(lengths, values, rank, batch, names[:3])).wait()
    sequences.update(replicated(local_kjt(lengths, values, rank, batch, names[3:])))
    loss = _loss(sequences, head)
    loss.backward()
    _dense_sgd(replicated.parameters())
    return loss.detach(), sequences


def _tpu_step(model: DistributedModelParallel, item: Batch) -> tuple[torch.Tensor, dict[str, JaggedTensor]]:
    """A step without the pipeline: forward, backward (fused updates), SGD on the data-parallel
    table."""
    loss, output = model(item.to(TPU))
    loss.backward()
    _dense_sgd(p for _, p in in_backward_optimizer_filter(model.named_parameters()))
    return output


def _state(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """This rank's part of a model's state dict and, for a DMP model, its fused optimizer's, on
    the host, keys without `prefix`; a ShardedTensor contributes each local shard keyed with its
    layout."""
    out = {}
    for key, value in model.state_dict().items():
        out.update(_local(key.removeprefix(prefix), value))
    if isinstance(model, DistributedModelParallel):
        for key, entries in model.fused_optimizer.state_dict()["state"].items():
            for name, value in entries.items():
                out.update(_local(f"{key.removeprefix(prefix)}/{name}", value))
    return out


def _assert_step(got: tuple[torch.Tensor, dict[str, JaggedTensor]],
                 expected: tuple[torch.Tensor, dict[str, JaggedTensor]], exact: bool, what: str) -> None:
    """Same loss, and same features, lengths and values (bit for bit, or within 1e-5)."""
    (got_loss, got_sequences), (loss, sequences) = got, expected
    _assert_same(got_loss.cpu(), loss.cpu(), exact, f"{what} loss")
    assert sorted(got_sequences) == sorted(sequences), f"{what}: features {sorted(got_sequences)} vs {sorted(sequences)}"
    for key, sequence in sequences.items():
        got_sequence = got_sequences[key]
        assert torch.equal(got_sequence.lengths().cpu(), sequence.lengths().cpu()), f"{what} {key}: lengths differ"
        _assert_same(got_sequence.values().detach().cpu(), sequence.values().detach().cpu(), exact, f"{what} {key} values")


def compare_with_torchrec(rank: int, world: int, batch: int, checkpoint: str) -> None:
    """`TrainPipelineSparseDist` drives the tpu model (batches to the device, input distribution
    ahead, forward, backward, the fused Adagrad and the dense SGD) on the mixed plan for `STEPS`
    steps; TorchRec's CPU model takes them one by one: each step's loss and sequences (values and
    lengths), then the tables and optimizer state, agree within 1e-5. The model, detached from the
    pipeline, is saved to `checkpoint` and restored into a model built from other weights
    (bit-exact, and identical further steps). A sample longer than its table's max_seq_len is
    refused before any id moves."""
    gloo = _start(rank)
    rng = np.random.default_rng(7)
    head = torch.from_numpy(rng.standard_normal(DIM).astype(np.float32))
    steps = random_batches(rng, world, batch, STEPS)
    initial = _initial(seed=3)
    tpu_plan, cpu_plan = _plans(world)
    tpu = _tpu_model(tpu_plan, initial, head)
    sharded, replicated = _reference(cpu_plan, initial, gloo)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(tpu.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LEARNING_RATE))
    optimizer = CombinedOptimizer([tpu.fused_optimizer, dense])
    pipeline = TrainPipelineSparseDist(tpu, optimizer, TPU)
    batches = iter([_batch(local_kjt(lengths, values, rank, batch), batch) for lengths, values in steps])
    for step, (lengths, values) in enumerate(steps):
        expected = _reference_step(sharded, replicated, lengths, values, rank, batch, head)
        _assert_step(pipeline.progress(batches), expected, exact=False, what=f"step {step}")
    reference = {**_state(sharded), **_state(replicated, prefix="module.")}
    assert any("momentum1" in key for key in reference), f"no Adagrad state compared: {sorted(reference)}"
    _assert_states(_state(tpu, prefix="ec."), reference, exact=False, label=f"after {STEPS} steps")
    print(f"rank {rank}: sequence embeddings in TrainPipelineSparseDist match TorchRec", flush=True)
    tpu = pipeline.detach()
    optimizer.zero_grad()  # the pipeline zeroes gradients before each step, not after its last
    _resume_in_place(tpu, tpu_plan, head, rank, world, batch, gloo, checkpoint)
    _refuses_overlong_sequence(tpu, rank, batch)
    dist.destroy_process_group()


def _resume_in_place(tpu: DistributedModelParallel, plan: dict, head: torch.Tensor, rank: int, world: int,
                     batch: int, gloo: dist.ProcessGroup, path: str) -> None:
    """Save `tpu`, restore it into a model built from other weights: the same state bit for bit,
    and the same losses, sequences and state after more steps."""
    _save(tpu, path, gloo)
    restored = _tpu_model(plan, _initial(seed=11), head)
    _load(restored, path, gloo)
    _assert_states(_state(restored), _state(tpu), exact=True, label="restored")
    for step, (lengths, values) in enumerate(random_batches(np.random.default_rng(9), world, batch, RESUMED_STEPS)):
        item = _batch(local_kjt(lengths, values, rank, batch), batch)
        _assert_step(_tpu_step(restored, item), _tpu_step(tpu, item), exact=True, what=f"restored step {step}")
    _assert_states(_state(restored), _state(tpu), exact=True, label="restored after training")
    print(f"rank {rank}: checkpoint round trip ok", flush=True)


def _refuses_overlong_sequence(tpu: DistributedModelParallel, rank: int, batch: int) -> None:
    lengths = np.ones((len(tables()), batch), dtype=np.int64)
    lengths[0, batch // 2] = MAX_SEQ_LEN["t0"] + 2
    values = [np.zeros(int(row.sum()), dtype=np.int64) for row in lengths]
    try:
        tpu(_batch(local_kjt(lengths, values, 0, batch), batch).to(TPU))
    except ValueError as error:
        message = str(error)
        assert "'f0'" in message and "6 ids" in message and "max_seq_len 4" in message, message
    else:
        raise AssertionError("a sequence longer than max_seq_len was accepted")
    print(f"rank {rank}: over-long sequence refused", flush=True)
