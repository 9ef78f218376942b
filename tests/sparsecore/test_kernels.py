"""The kernels on meshes of 1, 2 and 8 stand-in devices, on randomised topologies and stacks.

* Lookup and a fused update (SGD and Adagrad) agree with a NumPy model of the ragged inputs.
* Buffers whose slots outside the partitions (gaps, pads, the undefined tail) hold garbage --
  huge and negative ids, samples in and out of range, NaN and inf gains -- give bit-identical
  results; an update leaves its
  gradient workspace all zeros, as it found it (the next step relies on that).
* The compiled lookup and update contain no copy of a table-sized buffer, and the update aliases
  the donated table, slots and workspace to its outputs. The detector is checked on a program
  that does copy.
* The TPU custom calls lower with the contract's operands, config and optimizer computation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsecore.api
from sparsecore import optimizers as opt
from sparsecore.api import SparseCoreEmbedding
from sparsecore.kernels import local_kernels
from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import PackedBatch, RaggedIds, UniqueRows, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology
from test_numerics import pooled_model, random_ids, row_gradients

# (devices, SparseCores per device, seed): N = 4, 4 and 8 partitions.
TOPOLOGIES = [(1, 4, 0), (2, 2, 1), (8, 1, 2)]


def lookup_selected(lookup_impl: str):
    """A module fixture under which every engine built defaults to `lookup_impl`'s lookup (for
    modules that rerun this suite's and `test_numerics`' lookup tests on another lookup)."""

    @pytest.fixture(scope="module", autouse=True)
    def selected():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sparsecore.api, "local_kernels", functools.partial(local_kernels, lookup_impl=lookup_impl))
            yield

    return selected


def tiny_lookup(lowered: bool = True, devices: int = 1) -> str:
    """The lookup of a one-feature engine on `devices` devices, built as the current defaults
    build it: as lowered text, or (`lowered=False`) as a jaxpr."""
    topology = Topology.cpu(devices, 2)
    stacks = stack_tables([FeatureSpec("f", TableSpec("t", 32, 8), 4)], topology)
    engine = SparseCoreEmbedding(stacks, topology)
    tables, _ = engine.init(jax.random.key(0))
    ids = RaggedIds(np.arange(4, dtype=np.int32), lengths=np.ones(4, int))
    batch = engine.put_batch(preprocess(stacks, {"f": ids}, topology))
    if lowered:
        return engine.lookup_program.lower(tables, batch).as_text()
    return str(jax.make_jaxpr(engine.lookup_fn)(tables, batch))


def random_model(
    rng: np.random.Generator, devices: int, sparsecores: int, optimizer: opt.OptimizerSpec
):
    """Random tables (vocab, dim, combiner) in one or two stacks, features with random batches."""
    n = devices * sparsecores
    combiner = str(rng.choice(["sum", "mean", "sqrtn"]))
    dim = int(rng.choice([4, 8, 16]))
    tables = [
        TableSpec(
            f"t{i}",
            int(rng.integers(n, 120)),
            int(rng.integers(1, dim + 1)),
            combiner=combiner,
            optimizer=optimizer,
        )
        for i in range(3)
    ]
    features = [FeatureSpec(f"f{i}", tables[i % 3], n * int(rng.integers(1, 4))) for i in range(4)]
    groups = [StackGroup(("t0", "t1"), rotation=int(rng.integers(0, n)))]
    return tables, features, groups


def garbage_outside_partitions(batch: PackedBatch, n: int, rng: np.random.Generator) -> PackedBatch:
    """The same buffers with every slot that is not a real entry overwritten by garbage."""
    devices, segments = batch.row_pointers.shape[0], batch.sizes.sparsecores_per_device
    segment = batch.sizes.coo_buffer_size_per_sparsecore
    ends = batch.row_pointers.reshape(devices, segments, -1)[..., :n]
    starts = np.concatenate([np.zeros_like(ends[..., :1]), (ends[..., :-1] + 7) // 8 * 8], axis=-1)
    position = np.arange(segment)
    real = (
        (position[:, None] >= starts[..., None, :]) & (position[:, None] < ends[..., None, :])
    ).any(-1)
    real = real.reshape(devices, -1)
    size = int((~real).sum())
    ids, sample_ids, gains = (
        a.copy() for a in (batch.embedding_ids, batch.sample_ids, batch.gains)
    )
    index = batch.unique.entry_unique_index.copy()
    ids[~real] = rng.choice([-(2**31), -1, 2**31 - 1, 10**6, 7], size)
    sample_ids[~real] = rng.choice([-(2**31), -5, 2**31 - 1, 10**5, 0, 1], size)
    gains[~real] = rng.choice(np.float32([np.nan, np.inf, -np.inf, 3e38, 1.0]), size)
    index[~real] = rng.choice([-(2**31), -1, 2**31 - 1, 12345], size)
    unique = dataclasses.replace(batch.unique, entry_unique_index=index)
    return dataclasses.replace(
        batch, embedding_ids=ids, sample_ids=sample_ids, gains=gains, unique=unique
    )


@pytest.mark.parametrize(
    "devices, sparsecores, seed", TOPOLOGIES, ids=[f"{d}dev_x{s}sc" for d, s, _ in TOPOLOGIES]
)
@pytest.mark.parametrize(
    "optimizer",
    [opt.SGD(learning_rate=0.5), opt.Adagrad(learning_rate=0.5)],
    ids=["sgd", "adagrad"],
)
def test_random_topologies_match_numpy_model_even_with_garbage(
    devices, sparsecores, seed, optimizer
):
    rng = np.random.default_rng(seed)
    tables, features, groups = random_model(rng, devices, sparsecores, optimizer)
    topology = Topology.cpu(devices, sparsecores)
    stacks = stack_tables(features, topology, groups)
    engine = SparseCoreEmbedding(
        stacks,
        topology,
        entry_chunk=int(rng.choice([8, 32, 128])),
        row_chunk=int(rng.choice([8, 64])),
        lanes=int(rng.choice([1, 2, 4])),
    )
    state, slots = engine.init(jax.random.key(seed))
    values = engine.unstack_tables(state)
    inputs = {
        f.name: random_ids(rng, f, weighted=bool(rng.integers(2)), max_len=7) for f in features
    }
    clean = preprocess(stacks, inputs, topology)
    dirty = {
        name: garbage_outside_partitions(b, topology.num_sparsecores, rng)
        for name, b in clean.items()
    }

    activations = engine.lookup(state, clean)
    for name, got in engine.lookup(state, dirty).items():
        np.testing.assert_array_equal(np.asarray(got), np.asarray(activations[name]))
    for feature in features:
        want = pooled_model(
            values[feature.table.name], inputs[feature.name], feature.table.combiner.value
        )
        np.testing.assert_allclose(
            np.asarray(activations[feature.name]), want, rtol=1e-5, atol=1e-5
        )

    grads = {f.name: jnp.asarray(rng.normal(size=f.output_shape).astype(np.float32)) for f in features}
    results = []
    for batch in (clean, dirty):
        fresh_tables, fresh_slots = engine.init(jax.random.key(seed))
        if batch is clean:
            new_tables, new_slots = engine.update(fresh_tables, fresh_slots, batch, grads)
        else:
            new_tables, new_slots, workspaces = engine.update_program(
                fresh_tables, fresh_slots, engine.new_workspaces(), engine.put_batch(batch), grads,
                engine.hyperparameters(),
            )
            for workspace in workspaces.values():
                assert not np.asarray(workspace).any()
        results.append((engine.unstack_tables(new_tables), engine.unstack_slots(new_slots)))
    (got, got_slots), (dirty_got, dirty_slots) = results
    for table in tables:
        np.testing.assert_array_equal(dirty_got[table.name], got[table.name])
        dense, touched = np.zeros(values[table.name].shape), np.zeros(table.vocabulary_size, bool)
        for feature in (f for f in features if f.table.name == table.name):
            g, t = row_gradients(
                dense.shape, inputs[feature.name], np.asarray(grads[feature.name]), table.combiner.value
            )
            dense, touched = dense + g, touched | t
        want = values[table.name].astype(np.float64)
        if isinstance(optimizer, opt.SGD):
            want[touched] -= optimizer.learning_rate * dense[touched]
        else:
            accumulator = dense[touched] ** 2
            want[touched] -= (
                optimizer.learning_rate
                * dense[touched]
                / (np.sqrt(accumulator) + optimizer.epsilon)
            )
            np.testing.assert_allclose(
                got_slots[table.name]["accumulator"][touched], accumulator, rtol=1e-5, atol=1e-6
            )
            np.testing.assert_array_equal(
                dirty_slots[table.name]["accumulator"], got_slots[table.name]["accumulator"]
            )
        np.testing.assert_allclose(got[table.name], want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- compiled programs

_COPY = re.compile(r"= (?:\(\s*)?f32\[([\d,]+)\][^=]*? copy(?:-start)?\(")


def table_sized_copies(hlo: str, rows: int) -> list[str]:
    """Lines of `hlo` that copy a float buffer with at least `rows` rows."""
    return [
        line.strip()
        for line in hlo.splitlines()
        if (match := _COPY.search(line)) and int(match.group(1).split(",")[0]) >= rows
    ]


def input_output_aliases(hlo: str) -> set[int]:
    """Parameter numbers the compiled module aliases to an output."""
    header = hlo.splitlines()[0]
    return {int(p) for p in re.findall(r"\{[\d,\s]*\}:\s*\((\d+),", header)}


def test_copy_detector_sees_the_copy_of_a_gather_and_scatter_on_one_donated_table():
    table = jnp.zeros((65536, 64), jnp.float32)
    rows = jnp.arange(1024, dtype=jnp.int32) * 7

    def update_then_lookup(table, rows):
        # The lookup reads the old table after the in-place scatter: XLA must copy it first.
        return table.at[rows].add(1.0), table[rows + 1].sum()

    hlo = jax.jit(update_then_lookup, donate_argnums=0).lower(table, rows).compile().as_text()
    assert table_sized_copies(hlo, 65536)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda d: f"{d}dev")
def compiled(request):
    """The lookup and update programs of a realistically sized stack (compiled, not run)."""
    devices = request.param
    topology = Topology.cpu(devices, 4)
    spec = opt.RowWiseAdagrad()
    tables = [
        TableSpec(
            f"t{i}",
            32768,
            64,
            optimizer=spec,
            max_ids_per_partition=512,
            max_unique_ids_per_partition=256,
        )
        for i in range(2)
    ]
    features = [FeatureSpec(f"f{i}", tables[i], 256) for i in range(2)]
    stacks = stack_tables(features, topology, [StackGroup(("t0", "t1"))])
    engine = SparseCoreEmbedding(stacks, topology)
    state, slots = engine.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = engine.put_batch(
        preprocess(stacks, {f.name: random_ids(rng, f, False, 4) for f in features}, topology)
    )
    grads = {f.name: jnp.zeros(f.output_shape) for f in features}
    lookup = engine.lookup_program.lower(state, batch).compile().as_text()
    update = (
        engine.update_program.lower(state, slots, engine.new_workspaces(), batch, grads, engine.hyperparameters())
        .compile()
        .as_text()
    )
    rows = state[stacks[0].name].shape[0] // devices
    workspace_rows = engine.new_workspaces()[stacks[0].name].shape[0] // devices
    return lookup, update, min(rows, workspace_rows)


def test_compiled_lookup_and_update_copy_no_table_nor_workspace(compiled):
    """`rows`: the smaller of a device's table and workspace rows. The optimizer loop reads a
    block of workspace rows and clears it in place; XLA copies the whole workspace if it cannot
    order the read before the write."""
    lookup, update, rows = compiled
    assert table_sized_copies(lookup, rows) == []
    assert table_sized_copies(update, rows) == []


def test_compiled_update_aliases_the_donated_table_slots_and_workspace(compiled):
    _, update, _ = compiled
    # Parameters in pytree order: the table, the slots (accumulator, step), the workspace.
    assert input_output_aliases(update) == {0, 1, 2, 3}


# ----------------------------------------------------------------------------- TPU lowering


def tpu_engine(optimizer: opt.OptimizerSpec):
    """An engine with the TPU kernels on the CPU mesh (lowered for "tpu", never run), its state
    and a batch."""
    topology = Topology.cpu(1, 2)
    table = TableSpec("t", 64, 8, optimizer=optimizer, max_ids_per_partition=32, max_unique_ids_per_partition=16)
    stacks = stack_tables([FeatureSpec("f", table, 8)], topology)
    engine = SparseCoreEmbedding(stacks, topology, kernels=local_kernels("tpu"))
    state, slots = engine.init(jax.random.key(0))
    ids = RaggedIds(np.arange(8, dtype=np.int32), lengths=np.ones(8, int))
    return engine, state, slots, engine.put_batch(preprocess(stacks, {"f": ids}, topology))


def lower_update_for_tpu(engine, state, slots, batch) -> str:
    grads = {"f": jnp.zeros((8, 8))}
    args = (state, slots, engine.new_workspaces(), batch, grads, engine.hyperparameters())
    return jax.jit(engine.update_fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_tpu_custom_calls_lower_with_the_contract():
    engine, state, slots, batch = tpu_engine(opt.Adagrad(learning_rate=0.1))
    lookup = jax.jit(engine.lookup_fn).trace(state, batch).lower(lowering_platforms=("tpu",)).as_text()
    (call,) = [line for line in lookup.splitlines() if "custom_call @SparseDenseMatmulOp(" in line]
    config = json.loads(re.search(r'backend_config = "(.*?)"\}', call).group(1).replace("\\22", '"'))
    assert config == {
        "sparse_dense_matmul_config": {
            "max_ids_per_partition": 32,
            "max_unique_ids_per_partition": 16,
            "pad_value": 2**31 - 1,
            "sharding_strategy": 1,
        },
        "device_type": "DEVICE_TYPE_SPARSECORE",
    }
    assert call.count("%") == 7  # the result and six operands: 4 buffers, table, zeros

    update = lower_update_for_tpu(engine, state, slots, batch)
    (call,) = [line for line in update.splitlines() if "custom_call @SparseDenseMatmulGradOpWithOptimizerUpdate(" in line]
    config = json.loads(re.search(r'backend_config = "(.*?)"', call).group(1).replace("\\22", '"'))
    assert config["sparse_dense_matmul_config"]["num_slot_variables"] == 1
    assert config["sparse_dense_matmul_config"]["num_hyperparameters"] == 3  # lr, epsilon, step
    (computation,) = re.findall(r"called_computations = \[@([\w.]+)\]", call)
    signature = re.search(rf"func.func private @{computation}\((.*?)\) -> (.*?) \{{", update)
    assert signature.group(1).count("tensor<1x8xf32>") == 6  # grad, row, accumulator, 3 hyper-parameters
    assert signature.group(2) == "tuple<tensor<1x8xf32>, tensor<1x8xf32>>"


def test_tpu_update_rejects_per_row_slots():
    engine, state, slots, batch = tpu_engine(opt.RowWiseAdagrad())
    with pytest.raises(ValueError, match=r"per-row slot\(s\) \['accumulator'\]"):
        lower_update_for_tpu(engine, state, slots, batch)


# ----------------------------------------------------------------------------- buffer checks


def test_optimizer_loop_clears_exactly_the_slots_it_applied():
    """The optimizer loop walks each target SparseCore's used workspace slots in steps of
    `row_step`; a target's last step can reach into the next target's slots (here M = 12 slots
    per target, steps of 8). Every used slot is applied once and left zero, and a slot of the next
    target read by that overreaching step keeps its gradient until its own step applies it."""
    from sparsecore.kernels.geometry import KernelGeometry
    from sparsecore.kernels.grad_update import apply_optimizer, workspace_rows

    geometry = KernelGeometry(
        name="overreach", num_devices=1, sparsecores_per_device=2, row_pointers_per_sparsecore=8,
        coo_buffer_size=16, batch_size_per_sparsecore=4, rows_per_shard=16, embedding_dim=4,
        logical_embedding_dim=4, max_ids_per_partition=8, max_unique_ids_per_partition=8,
        unique_rows_per_partition=12, entry_chunk=8, row_chunk=8, features=(),
    )
    merged, step = geometry.merged_rows_per_sparsecore, geometry.row_step
    assert (merged, step) == (12, 8)
    counts = np.array([10, 5], np.int32)  # target 0's second step reads slots 8..15, i.e. 12..15 of target 1
    rng = np.random.default_rng(0)
    workspace = np.zeros((workspace_rows(geometry), 4), np.float32)
    rows = np.full(2 * merged, geometry.rows_per_device, np.int32)
    table = rng.normal(size=(geometry.rows_per_device, 4)).astype(np.float32)
    want = table.copy()
    for target, count in enumerate(counts):
        slots = target * merged + np.arange(count)
        rows[slots] = target * geometry.rows_per_shard + rng.permutation(geometry.rows_per_shard)[:count]
        workspace[slots] = rng.normal(size=(count, 4))
        want[rows[slots]] -= 0.5 * workspace[slots]
    new_table, _, new_workspace = jax.jit(
        lambda t, w, r, c: apply_optimizer(t, {}, w, r, c, opt.SGD(), {"learning_rate": jnp.float32(0.5)}, geometry)
    )(table, workspace, rows, counts)
    np.testing.assert_allclose(np.asarray(new_table), want, rtol=1e-6)
    assert not np.asarray(new_workspace).any()


def test_geometry_holds_each_features_block_and_refuses_bad_ones():
    from sparsecore.kernels.geometry import FeatureBlock

    topology = Topology.cpu(1, 2)
    features = [
        FeatureSpec("f", TableSpec("t", 64, 8), 8),
        FeatureSpec("g", TableSpec("u", 64, 4), 4, max_sequence_length=3),
    ]
    stacks = stack_tables(features, topology, [StackGroup(("t", "u"))])
    geometry = SparseCoreEmbedding(stacks, topology).geometries[stacks[0].name]
    assert geometry.features == (FeatureBlock(0, 4, 8), FeatureBlock(4, 6, 4))
    for bad in [
        (FeatureBlock(0, 4, 8), FeatureBlock(3, 6, 4)),
        (FeatureBlock(4, 6, 4), FeatureBlock(0, 4, 8)),
        (FeatureBlock(0, 4, 9),),
        (FeatureBlock(5, 6, 4),),
        (FeatureBlock(0, 0, 8),),
    ]:
        with pytest.raises(ValueError, match="feature blocks .* are not non-empty, in order and disjoint"):
            dataclasses.replace(geometry, features=bad)


def test_loop_lanes_must_be_a_power_of_two():
    topology = Topology.cpu(1, 2)
    stacks = stack_tables([FeatureSpec("f", TableSpec("t", 64, 8), 8)], topology)
    with pytest.raises(ValueError, match="lanes must be a power of two, got 3"):
        SparseCoreEmbedding(stacks, topology, lanes=3)


def test_put_batch_names_the_partition_with_bad_row_pointers():
    topology = Topology.cpu(2, 2)
    table = TableSpec("t", 64, 8, max_ids_per_partition=8, max_unique_ids_per_partition=8)
    stacks = stack_tables([FeatureSpec("f", table, 8)], topology)
    engine = SparseCoreEmbedding(stacks, topology)
    batch = preprocess(
        stacks, {"f": RaggedIds(np.arange(8, dtype=np.int32), lengths=np.ones(8, int))}, topology
    )["t"]
    row_pointers = batch.row_pointers.copy()
    row_pointers[1, 8 + 2] = (
        row_pointers[1, 8 + 1] + 9
    )  # device 1, SparseCore 1, partition 2: 9 > 8 entries
    bad = dataclasses.replace(batch, row_pointers=row_pointers)
    with pytest.raises(
        ValueError,
        match=r"stack 't': local device 1, SparseCore 1, partition 2: row pointers give 9",
    ):
        engine.put_batch({"t": bad})
    wrong_shape = dataclasses.replace(batch, gains=batch.gains[:, :-8])
    with pytest.raises(ValueError, match="gains has shape"):
        engine.put_batch({"t": wrong_shape})
    assert isinstance(batch.unique, UniqueRows)
