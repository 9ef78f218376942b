"""The torch ops: registered under torch.ops.tpu with TorchTPU's argument order, fake
implementations for tracing, clear errors, and for every sparsecore optimizer the same training
as sparsecore's own jitted API on the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from _references import bag_tables, kjt_keys, random_kjt
from embeddings import SparseCoreEmbeddingBagCollection
from embeddings.ops import BUFFERS, sparse_dense_matmul
from sparsecore import optimizers as opt
from sparsecore.api import SparseCoreEmbedding
from sparsecore.preprocess import RaggedIds, preprocess

BATCH = 32


def _argument_names(op) -> list[str]:
    return [argument.name for argument in op.default._schema.arguments]


def test_ops_follow_torchtpu_argument_order():
    statics = ["batch_size", "max_ids_per_partition", "max_unique_ids_per_partition", "computation_name"]
    lookup = torch.ops.tpu.sparse_dense_matmul
    buffers = ["row_pointers", "embedding_ids", "sample_ids", "gains"]
    assert _argument_names(lookup) == [*buffers, "embedding_table", *statics]
    adagrad = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad
    assert _argument_names(adagrad) == [
        *BUFFERS, "embedding_table", "accumulator", "step", "activations_grad", "learning_rate", "epsilon",
        "clip_gradient", "gradient_workspace", *statics,  # TorchTPU's, then the stand-in's scratch
    ]
    assert _argument_names(torch.ops.tpu.sparse_dense_matmul_grad_with_sgd)[6:11] == [
        "embedding_table", "step", "activations_grad", "learning_rate", "clip_gradient",
    ]
    momentum = _argument_names(torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad_momentum)
    assert momentum[6:9] == ["embedding_table", "accumulator", "momentum_slot"] and "momentum" in momentum
    for name in ("rowwise_adagrad", "adam", "ftrl", "laprop"):
        assert hasattr(torch.ops.tpu, f"sparse_dense_matmul_grad_with_{name}")


@pytest.fixture(scope="module")
def module_and_batch():
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=opt.Adagrad(learning_rate=0.1))
    batch = ebc.prepare(random_kjt(np.random.default_rng(0), kjt_keys(tables), BATCH))
    return ebc, batch


def test_fake_implementation_gives_the_stack_activation_shape(module_and_batch):
    ebc, batch = module_and_batch
    name, computation = next(iter(ebc._computations.items()))
    stack = computation.stack
    with FakeTensorMode() as mode:
        inputs = [mode.from_tensor(t) for t in (*batch.buffers[name][:4], ebc.stacked_state.table(name))]
        out = sparse_dense_matmul(*inputs, **computation.static_args)
    assert tuple(out.shape) == (stack.total_sample_count, stack.embedding_dim)
    assert out.device.type == "tpu" and out.dtype == torch.float32


def test_bad_static_arguments_are_named(module_and_batch):
    ebc, batch = module_and_batch
    name, computation = next(iter(ebc._computations.items()))
    inputs = (*batch.buffers[name][:4], ebc.stacked_state.table(name))
    with pytest.raises(ValueError, match="no SparseCore computation named 'nope'"):
        sparse_dense_matmul(*inputs, **{**computation.static_args, "computation_name": "nope"})
    with pytest.raises(ValueError, match="static arguments {'batch_size': 7} do not match.*'batch_size': 64"):
        sparse_dense_matmul(*inputs, **{**computation.static_args, "batch_size": 7})
    state = ebc.stacked_state
    grad = torch.zeros(computation.stack.total_sample_count, computation.stack.embedding_dim, device="tpu")
    with pytest.raises(ValueError, match="updates with Adagrad, not SGD"):
        torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(
            *batch.buffers[name], state.table(name), state.step(name), grad, *state.hyperparameters(opt.SGD()),
            state.workspace(name), **computation.static_args,
        )


def _ragged(kjt) -> dict[str, RaggedIds]:
    return {
        key: RaggedIds(jagged.values().numpy(), lengths=jagged.lengths().numpy())
        for key, jagged in kjt.to_dict().items()
    }


@pytest.mark.parametrize(
    "optimizer",
    [
        opt.AdagradMomentum(learning_rate=0.05, use_nesterov=True),
        opt.FTRL(learning_rate=0.05, l1_regularization_strength=0.001),
        opt.LaProp(learning_rate=0.01),
        opt.Adam(learning_rate=0.01, clip_gradient=0.5),
    ],
    ids=lambda o: type(o).__name__,
)
def test_every_optimizer_trains_as_the_sparsecore_api(optimizer):
    tables = bag_tables()[::2]
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=optimizer)
    state = ebc.stacked_state
    engine = SparseCoreEmbedding(tuple(state.engine.stacks.values()), state.engine.topology)
    weights = {key.split(".")[1]: value.numpy() for key, value in ebc.state_dict().items()}
    stacks = tuple(engine.stacks.values())
    engine_tables, engine_slots = engine.place_tables(weights), engine.init_slots()
    rng = np.random.default_rng(7)
    dims = [t.embedding_dim for t in tables]
    for _ in range(3):
        kjt = random_kjt(rng, kjt_keys(tables), BATCH)
        grad = rng.standard_normal((BATCH, sum(dims))).astype(np.float32)
        out = ebc(kjt).values()
        packed = preprocess(stacks, _ragged(kjt), engine.topology)
        expected = engine.lookup(engine_tables, packed)
        names = [t.feature_names[0] for t in tables]
        np.testing.assert_allclose(out.detach().cpu().numpy(), np.concatenate([expected[n] for n in names], 1),
                                   rtol=0, atol=1e-6)
        (out * torch.from_numpy(grad).to("tpu")).sum().backward()
        splits = np.split(grad, np.cumsum(dims)[:-1], axis=1)
        engine_tables, engine_slots = engine.update(
            engine_tables, engine_slots, packed, dict(zip(names, splits))
        )
    trained = engine.unstack_tables(engine_tables)
    slots = engine.unstack_slots(engine_slots)
    for table in (t.name for t in tables):
        weight = ebc.state_dict()[f"embedding_bags.{table}.weight"].numpy()
        np.testing.assert_allclose(weight, trained[table], rtol=0, atol=1e-6)
        for slot in optimizer.slots():
            where = state.table_slot(table, slot.name)
            expected = slots[table][slot.name].reshape(where.shape)
            np.testing.assert_allclose(state.to_host(where), expected, rtol=0, atol=1e-6)
        assert state.step_count(table) == 3.0
