"""The SparseCore collections against references no one here wrote, on the session's 4 stand-in
devices x 4 SparseCores: forward equals TorchRec's unsharded modules with the same weights; after
10 steps the tables equal FBGEMM's fused optimizers (SGD, Adagrad, row-wise Adagrad) or
SparseAdam (Adam) within 1e-5, in strict, DeferAndFuse and compiled modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedTensor

import torchtpu
from torchtpu import storage
from _references import (
    OPTIMIZERS,
    TorchRecSequenceTraining,
    bag_tables,
    check_bag_training,
    kjt_keys,
    random_kjt,
    sequence_tables,
)
from embeddings import SparseCoreEmbeddingBagCollection, SparseCoreEmbeddingCollection, SparseCoreEmbeddingConfig
from sparsecore.layout import StackGroup

BATCH = 32
STEPS = 10
TOLERANCE = {"rtol": 0.0, "atol": 1e-5}
# One stack of dims 16, 8, 16, 8: narrower tables are padded to the stack's dim, so each
# feature's activations are cut out of the stack on their own (not one transpose).
MIXED_DIMS = [StackGroup(("t1", "t0", "t3", "t2"))]


def _tables(module) -> dict[str, torch.Tensor]:
    prefix = "embedding_bags." if isinstance(module, SparseCoreEmbeddingBagCollection) else "embeddings."
    return {key[len(prefix) : -len(".weight")]: value for key, value in module.state_dict().items()}


def _run(module, mode: str):
    return torch.compile(module, backend="tpu") if mode == "compiled" else module


def _eager_mode(mode: str) -> str:
    return "defer" if mode == "defer" else "strict"


@pytest.mark.parametrize(
    "pooling, weighted, stacking",
    [
        (PoolingType.SUM, False, "auto"),
        (PoolingType.MEAN, False, "none"),
        (PoolingType.SUM, True, [StackGroup(("t0", "t2")), StackGroup(("t3", "t1"))]),
        (PoolingType.SUM, False, MIXED_DIMS),
    ],
    ids=["sum-auto", "mean-per_table", "weighted-manual", "sum-mixed_dims"],
)
def test_forward_matches_torchrec(pooling, weighted, stacking):
    tables = bag_tables(pooling)
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, stacking=stacking, is_weighted=weighted)
    if stacking == "auto":
        assert ebc.stacks == {"t0_t2": ("t0", "t2"), "t1_t3": ("t1", "t3")}
    reference = EmbeddingBagCollection(tables, is_weighted=weighted)
    reference.load_state_dict(ebc.state_dict())
    rng = np.random.default_rng(1)
    for _ in range(2):
        kjt = random_kjt(rng, kjt_keys(tables), BATCH, weighted=weighted)
        out, expected = ebc(kjt), reference(kjt)
        assert isinstance(out, KeyedTensor) and out.keys() == expected.keys()
        assert out.length_per_key() == expected.length_per_key()
        torch.testing.assert_close(out.values().cpu(), expected.values(), rtol=0, atol=1e-6)


def test_feature_read_by_two_tables_gets_torchrec_names():
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=64, embedding_dim=8, feature_names=["shared", "x"]),
        EmbeddingBagConfig(name="b", num_embeddings=128, embedding_dim=8, feature_names=["shared"]),
    ]
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH)
    reference = EmbeddingBagCollection(tables)
    reference.load_state_dict(ebc.state_dict())
    kjt = random_kjt(np.random.default_rng(2), [("shared", 64), ("x", 64)], BATCH)
    out, expected = ebc(kjt), reference(kjt)
    assert out.keys() == expected.keys() == ["shared@a", "x", "shared@b"]
    torch.testing.assert_close(out.values().cpu(), expected.values(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["strict", "defer", "compiled"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_training_matches_fused_reference(optimizer, mode):
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS[optimizer])
    _check_training(ebc, tables, optimizer, mode)


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_training_a_stack_of_mixed_dims_matches_fused_reference(mode):
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS["sgd"], stacking=MIXED_DIMS)
    assert ebc.stacks == {"t1_t0_t3_t2": ("t1", "t0", "t3", "t2")}
    _check_training(ebc, tables, "sgd", mode)


def _check_training(ebc: SparseCoreEmbeddingBagCollection, tables, optimizer: str, mode: str) -> None:
    torchtpu.reset_metrics()
    with torchtpu.eager_mode(_eager_mode(mode)):
        check_bag_training(ebc, _run(ebc, mode), tables, optimizer, STEPS, BATCH, slice(0, BATCH), seed=3)
    if mode == "compiled":
        metrics = torchtpu.metrics()
        assert metrics.get("compiled_graphs", 0) >= 2 and "compiled_graphs_split" not in metrics


def _device_addresses(ebc: SparseCoreEmbeddingBagCollection) -> list[tuple[int, ...]]:
    """Where each stack's table and slots live: the device memory of every shard of their buffers."""
    torch.tpu.synchronize()
    state = ebc.stacked_state
    return [
        tuple(shard.data.unsafe_buffer_pointer() for shard in storage.buffer_of(t).value.addressable_shards)
        for stack in ebc.stacks
        for t in (state.table(stack), *state.slots(stack))
    ]


@pytest.mark.parametrize("mode", ["strict", "defer", "compiled"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_update_writes_tables_and_slots_where_they_are(optimizer, mode):
    """The fused update scatters into the table's own buffer (donated), as SparseCore does: a step
    copies no table. (Updating a copy and copying it back cost two table-sized copies a step.)"""
    ebc = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS[optimizer])
    run = _run(ebc, mode)
    rng = np.random.default_rng(4)
    with torchtpu.eager_mode(_eager_mode(mode)):
        for _ in range(3):
            before = _device_addresses(ebc)
            run(random_kjt(rng, kjt_keys(bag_tables()), BATCH)).values().sum().backward()
            assert _device_addresses(ebc) == before


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sequence_collection_matches_torchrec(optimizer):
    tables = sequence_tables()
    configs = [SparseCoreEmbeddingConfig(t, max_seq_len=5) for t in tables]
    ec = SparseCoreEmbeddingCollection(configs, batch_size=BATCH, optimizer=OPTIMIZERS[optimizer], need_indices=True)
    reference = TorchRecSequenceTraining(tables, _tables(ec), optimizer)
    rng = np.random.default_rng(4)
    for _ in range(STEPS):
        kjt = random_kjt(rng, kjt_keys(tables), BATCH, max_length=5)
        out, expected = ec(kjt), reference.forward(kjt)
        grads = {}
        for name, jagged in expected.items():
            torch.testing.assert_close(out[name].values().detach().cpu(), jagged.values().detach(), **TOLERANCE)
            assert torch.equal(out[name].lengths().cpu(), jagged.lengths())
            assert torch.equal(out[name].weights().cpu(), jagged.weights())
            grads[name] = torch.from_numpy(rng.standard_normal(tuple(jagged.values().shape)).astype(np.float32))
        sum((out[name].values() * grad.to("tpu")).sum() for name, grad in grads.items()).backward()
        reference.step(kjt, grads)
    trained, expected = _tables(ec), reference.tables()
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], **TOLERANCE, msg=name)


def test_sequence_collection_compiled():
    tables = sequence_tables()
    configs = [SparseCoreEmbeddingConfig(t, max_seq_len=5) for t in tables]
    ec = SparseCoreEmbeddingCollection(configs, batch_size=BATCH, optimizer=OPTIMIZERS["adagrad"])
    reference = TorchRecSequenceTraining(tables, _tables(ec), "adagrad")
    # The jagged outputs' sizes follow the data: compile them static (one graph per size), as
    # graphs with symbolic sizes are lowered at their traced sizes.
    run = torch.compile(ec, backend="tpu", dynamic=False)
    rng = np.random.default_rng(5)
    torchtpu.reset_metrics()
    for _ in range(3):
        kjt = random_kjt(rng, kjt_keys(tables), BATCH, max_length=5)
        expected = reference.forward(kjt)
        grads = {name: torch.from_numpy(rng.standard_normal(tuple(j.values().shape)).astype(np.float32))
                 for name, j in expected.items()}
        out = run(kjt)
        sum((out[name].values() * grad.to("tpu")).sum() for name, grad in grads.items()).backward()
        reference.step(kjt, grads)
    trained, expected = _tables(ec), reference.tables()
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], **TOLERANCE, msg=name)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_state_dict_round_trip_and_errors():
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH)
    other = EmbeddingBagCollection(tables)
    ebc.load_state_dict(other.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(ebc.state_dict()[key], value), key
    assert list(ebc.state_dict()) == [f"embedding_bags.t{i}.weight" for i in range(4)]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*embedding_bags.t1.weight"):
        ebc.load_state_dict({k: v for k, v in other.state_dict().items() if "t1" not in k})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*embedding_bags.t9.weight"):
        ebc.load_state_dict({**other.state_dict(), "embedding_bags.t9.weight": torch.zeros(1)})
    bad = dict(other.state_dict(), **{"embedding_bags.t0.weight": torch.zeros(65, 8)})
    with pytest.raises(RuntimeError, match=r"embedding_bags.t0.weight.*\(65, 8\).*\(64, 8\)"):
        ebc.load_state_dict(bad)


def test_loading_tables_writes_each_stack_once(monkeypatch):
    """A state dict's tables go to the device one program per stacked variable, not per table
    (at MLPerf's 26 tables, per-table writes made building a model take half a minute)."""
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH)
    stacks = {ebc.stacked_state.table_slot(t.name, None).stack.name for t in tables}
    assert len(stacks) < len(tables)  # stacking is what makes the count differ
    writes = []
    original = type(ebc.stacked_state)._write_rows
    monkeypatch.setattr(type(ebc.stacked_state), "_write_rows",
                        lambda state, group: (writes.append([where.table for where, _ in group]),
                                              original(state, group)))
    other = EmbeddingBagCollection(tables)
    ebc.load_state_dict(other.state_dict())
    assert len(writes) == len(stacks) and sorted(sum(writes, [])) == sorted(t.name for t in tables)
    for key, value in other.state_dict().items():
        assert torch.equal(ebc.state_dict()[key], value), key


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="takes EmbeddingBagConfigs"):
        SparseCoreEmbeddingBagCollection(sequence_tables(), batch_size=BATCH)
    with pytest.raises(ValueError, match="s0.*needs max_seq_len"):
        SparseCoreEmbeddingCollection(sequence_tables(), batch_size=BATCH)
    with pytest.raises(ValueError, match="cannot be split evenly over the 16 SparseCores"):
        SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=12)
    with pytest.raises(ValueError, match="distinct names"):
        SparseCoreEmbeddingBagCollection(bag_tables()[:1] * 2, batch_size=BATCH)


def test_custom_init_fn_runs_on_the_host():
    table = EmbeddingBagConfig(name="t", num_embeddings=40, embedding_dim=8, feature_names=["f"],
                               init_fn=lambda w: torch.nn.init.constant_(w, 0.25))
    ebc = SparseCoreEmbeddingBagCollection([table], batch_size=BATCH)
    assert torch.equal(ebc.state_dict()["embedding_bags.t.weight"], torch.full((40, 8), 0.25))


def test_eval_without_grad_does_not_update():
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS["sgd"])
    before = _tables(ebc)
    with torch.no_grad():
        out = ebc(random_kjt(np.random.default_rng(6), kjt_keys(tables), BATCH))
    assert not out.values().requires_grad
    after = _tables(ebc)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_reference_unsharded_collection_loads_sequence_tables():
    tables = sequence_tables()
    ec = SparseCoreEmbeddingCollection([SparseCoreEmbeddingConfig(t, max_seq_len=5) for t in tables], batch_size=BATCH)
    reference = EmbeddingCollection(tables)
    reference.load_state_dict(ec.state_dict())
    assert set(ec.state_dict()) == set(reference.state_dict())


def test_tables_the_device_has_no_room_for_raise_torchs_out_of_memory_error(monkeypatch):
    """As on CUDA (`torch.cuda.OutOfMemoryError` is `torch.OutOfMemoryError`), when the runtime
    reports it while making the tables. (Asking the stand-in for tables larger than the host lets
    some allocations through, and the kernel's out-of-memory killer ends the process.)"""
    import jax

    from sparsecore.api import SparseCoreEmbedding

    def exhausted(self, key):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4398046511104 bytes.")

    monkeypatch.setattr(SparseCoreEmbedding, "init", exhausted)
    table = EmbeddingBagConfig(name="t", num_embeddings=64, embedding_dim=8, feature_names=["f"])
    with pytest.raises(torch.OutOfMemoryError, match="tpu out of memory: RESOURCE_EXHAUSTED"):
        SparseCoreEmbeddingBagCollection([table], batch_size=64)
