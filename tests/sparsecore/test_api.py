"""The functional API: sharded initialisation and placement, hyper-parameters as arrays (no
recompilation), donation, errors that name what is wrong, and the custom-VJP convenience."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sparsecore import optimizers as opt
from sparsecore.api import AXIS, SparseCoreEmbedding, differentiable_lookup
from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import RaggedIds, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

TOPOLOGY = Topology.cpu(2, 2)


def build(optimizer=None, initializer=None):
    """Tables a (dim 8) and b stacked; b has dim 6 (padded to 8) unless the optimizer keeps a
    row-wise slot, which averages over one dim per stack (then 8)."""
    optimizer = optimizer or opt.SGD(learning_rate=0.1)
    b_dim = 8 if any(slot.per_row for slot in optimizer.slots()) else 6
    tables = [
        TableSpec("a", 40, 8, optimizer=optimizer, initializer=initializer),
        TableSpec("b", 24, b_dim, optimizer=optimizer, initializer=initializer),
    ]
    features = [FeatureSpec("fa", tables[0], 8), FeatureSpec("fb", tables[1], 8)]
    stacks = stack_tables(features, TOPOLOGY, [StackGroup(("a", "b"), name="ab")])
    return SparseCoreEmbedding(stacks, TOPOLOGY, entry_chunk=32, row_chunk=16), features


def batch_for(features, seed=0, **kwargs):
    rng = np.random.default_rng(seed)
    inputs = {
        f.name: RaggedIds(rng.integers(0, f.table.vocabulary_size, 24).astype(np.int32), lengths=np.full(8, 3))
        for f in features
    }
    return inputs


def ones_like_outputs(features):
    return {f.name: jnp.ones(f.output_shape) for f in features}


@contextlib.contextmanager
def count_compiles():
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_changing_hyperparameters_does_not_recompile():
    engine, features = build(opt.SGD(learning_rate=0.1))
    stacks = tuple(engine.stacks.values())
    batch = engine.put_batch(preprocess(stacks, batch_for(features), TOPOLOGY))
    grads = ones_like_outputs(features)
    tables, slots = engine.init(jax.random.key(0))
    start = engine.unstack_tables(tables)
    with count_compiles() as first_compiles:
        tables, slots = engine.update(tables, slots, batch, grads, {"ab": {"learning_rate": 0.1}})
    assert first_compiles, "the listener must see the first call compile"
    first = engine.unstack_tables(tables)
    with count_compiles() as compiles:
        tables, slots = engine.update(tables, slots, batch, grads, {"ab": {"learning_rate": 0.3}})
        second = engine.unstack_tables(tables)
    assert compiles == []
    # The new rate took effect: SGD's second step is 3x the first on every touched row.
    np.testing.assert_allclose(second["a"] - first["a"], 3 * (first["a"] - start["a"]), rtol=1e-4, atol=1e-6)
    assert np.abs(first["a"] - start["a"]).max() > 0


def test_init_applies_each_initializer_sharded_with_zero_padding():
    engine, _ = build(opt.FTRL(), initializer="normal(0.5)")
    key = jax.random.key(7)
    tables, slots = engine.init(key)
    stacked = tables["ab"]
    assert stacked.sharding.spec == P(AXIS) and len(stacked.sharding.device_set) == 2
    values = engine.unstack_tables(tables)
    for index, name in enumerate(("a", "b")):
        spec = engine.stacks["ab"].table(name).table
        want = spec.initializer(jax.random.fold_in(key, index), (spec.vocabulary_size, spec.embedding_dim), jnp.float32)
        np.testing.assert_array_equal(values[name], np.asarray(want))
    # Every row that belongs to no table, and the columns past a table's dim, are zero.
    total = np.abs(np.asarray(stacked)).sum()
    assert total == pytest.approx(sum(np.abs(v).sum() for v in values.values()), rel=1e-6)
    accumulator = engine.unstack_slots(slots)["a"]["accumulator"]
    np.testing.assert_array_equal(accumulator, np.full((40, 8), 0.1, np.float32))
    assert float(slots["ab"]["step"]) == 0.0


def test_init_shares_one_program_between_tables_of_nearby_sizes():
    """Tables of 40 and 24 rows draw 64 rows, 100 and 103 draw 104 (rounded up by less than an
    eighth): two initializer programs for four tables, each table still holding exactly its own
    exact-size draw, as a callable initializer (drawn at each table's own size) does."""
    sizes = {"a": 40, "b": 24, "c": 100, "d": 103}
    named = [TableSpec(n, v, 8, initializer="uniform(-0.5, 0.5)") for n, v in sizes.items()]
    custom = [TableSpec(n, v, 8, initializer=lambda k, shape, dtype: jax.random.normal(k, shape, dtype)) for n, v in sizes.items()]
    key = jax.random.key(11)
    for tables, programs in ((named, 2), (custom, 4)):
        features = [FeatureSpec(f"f{t.name}", t, 8) for t in tables]
        stacks = stack_tables(features, TOPOLOGY, [StackGroup(tuple(sizes), name="abcd")])
        engine = SparseCoreEmbedding(stacks, TOPOLOGY)
        values = engine.unstack_tables(engine.init(key)[0])
        assert len(engine._table_initializers) == programs
        for index, spec in enumerate(tables):
            want = spec.initializer(jax.random.fold_in(key, index), (spec.vocabulary_size, 8), jnp.float32)
            np.testing.assert_array_equal(values[spec.name], np.asarray(want))


def test_place_tables_and_slots_round_trip():
    engine, _ = build(opt.RowWiseAdagrad())
    rng = np.random.default_rng(1)
    values = {"a": rng.normal(size=(40, 8)).astype(np.float32), "b": rng.normal(size=(24, 8)).astype(np.float32)}
    slot_values = {"a": {"accumulator": rng.random((40, 1)).astype(np.float32)}, "b": {"accumulator": rng.random((24, 1)).astype(np.float32)}}
    got = engine.unstack_tables(engine.place_tables(values))
    got_slots = engine.unstack_slots(engine.place_slots(slot_values, step=4))
    for name in values:
        np.testing.assert_array_equal(got[name], values[name])
        np.testing.assert_array_equal(got_slots[name]["accumulator"], slot_values[name]["accumulator"])


def test_update_donates_tables_and_slots_and_counts_steps():
    engine, features = build(opt.Adagrad())
    batch = preprocess(tuple(engine.stacks.values()), batch_for(features), TOPOLOGY)
    tables, slots = engine.init(jax.random.key(0))
    old_table, old_slot = tables["ab"], slots["ab"]["accumulator"]
    tables, slots = engine.update(tables, slots, batch, ones_like_outputs(features))
    assert old_table.is_deleted() and old_slot.is_deleted()
    tables, slots = engine.update(tables, slots, batch, ones_like_outputs(features))
    assert float(slots["ab"]["step"]) == 2.0


def test_errors_name_the_problem():
    engine, features = build()
    stacks = tuple(engine.stacks.values())
    tables, slots = engine.init(jax.random.key(0))
    packed = preprocess(stacks, batch_for(features), TOPOLOGY)
    grads = ones_like_outputs(features)
    with pytest.raises(ValueError, match=r"unknown stack\(s\) \['cd'\]"):
        engine.hyperparameters({"cd": {"learning_rate": 1.0}})
    with pytest.raises(ValueError, match=r"stack 'ab' \(SGD\) has no hyper-parameter\(s\) \['beta1'\]"):
        engine.hyperparameters({"ab": {"beta1": 1.0}})
    with pytest.raises(ValueError, match="no activation gradient for feature 'fb'"):
        engine.update(tables, slots, packed, {"fa": grads["fa"]})
    with pytest.raises(ValueError, match=r"feature 'fa': activation gradient has shape \(8, 7\), expected \(8, 8\)"):
        engine.update(tables, slots, packed, {**grads, "fa": jnp.ones((8, 7))})
    with pytest.raises(ValueError, match=r"batch has no buffers for stack\(s\) \['ab'\]"):
        engine.put_batch({})
    no_side_car = preprocess(stacks, batch_for(features), TOPOLOGY, with_unique_rows=False)
    with pytest.raises(ValueError, match="stack 'ab': the batch has no unique-row side-car"):
        engine.update(tables, slots, no_side_car, grads)
    with pytest.raises(ValueError, match="topology has 2 devices but 1 were given"):
        SparseCoreEmbedding(stacks, TOPOLOGY, devices=jax.devices()[:1])


def test_differentiable_lookup_returns_updated_state_as_cotangent():
    engine, features = build(opt.Adagrad(learning_rate=0.2))
    batch = engine.put_batch(preprocess(tuple(engine.stacks.values()), batch_for(features, seed=3), TOPOLOGY))
    tables, slots = engine.init(jax.random.key(2))
    lookup = differentiable_lookup(engine)
    hyper = engine.hyperparameters()
    weights = {f.name: jnp.arange(np.prod(f.output_shape), dtype=jnp.float32).reshape(f.output_shape) / 100 for f in features}

    def loss(tables, slots):
        activations = lookup(tables, slots, batch, hyper)
        return sum((activations[name] * weights[name]).sum() for name in activations)

    new_tables, new_slots = jax.jit(jax.grad(loss, argnums=(0, 1)))(tables, slots)
    np.testing.assert_array_equal(
        np.asarray(lookup(tables, slots, batch, hyper)["fa"]), np.asarray(engine.lookup(tables, batch)["fa"])
    )
    want_tables, want_slots = engine.update(tables, slots, batch, weights)
    np.testing.assert_allclose(np.asarray(new_tables["ab"]), np.asarray(want_tables["ab"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(new_slots["ab"]["accumulator"]), np.asarray(want_slots["ab"]["accumulator"]), rtol=1e-6
    )
    assert float(new_slots["ab"]["step"]) == 1.0


def test_kernels_run_with_64_bit_mode_on():
    """The torch backend turns jax_enable_x64 on; index arithmetic must keep its int32 types."""
    results = []
    for x64 in (False, True):
        with jax.enable_x64(x64):
            engine, features = build(opt.RowWiseAdagrad(learning_rate=0.2))
            packed = preprocess(tuple(engine.stacks.values()), batch_for(features, seed=5), TOPOLOGY)
            tables, slots = engine.init(jax.random.key(3))
            activations = engine.lookup(tables, packed)
            tables, slots = engine.update(tables, slots, packed, ones_like_outputs(features))
            results.append((np.asarray(activations["fa"]), engine.unstack_tables(tables)["a"]))
    (activations, table), (activations_x64, table_x64) = results
    np.testing.assert_array_equal(activations_x64, activations)
    np.testing.assert_array_equal(table_x64, table)
