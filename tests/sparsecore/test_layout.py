"""MOD sharding and stacking: exact round trips, the stacking rules, and their errors.

The golden layouts (test_golden.py) pin the conventions; here randomised tables check that
every transform is exactly invertible and consistent with `physical_row_ids`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecore.layout import (
    StackGroup,
    auto_stack_groups,
    auto_stack_tables,
    flatten_features,
    physical_row_ids,
    round_up,
    shard_and_local_row,
    shard_table,
    stack_and_shard,
    stack_tables,
    unshard_and_unstack,
    unshard_table,
)
from sparsecore.optimizers import SGD, Adagrad, RowWiseAdagrad
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

TOPOLOGIES = st.sampled_from([(1, 1), (1, 4), (2, 2), (2, 4), (8, 1), (8, 4)])


@settings(max_examples=40, deadline=None)
@given(TOPOLOGIES, st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_shard_table_round_trip(devices_and_scs, rows_per_shard, dim, seed):
    topology = Topology.cpu(*devices_and_scs)
    n = topology.num_sparsecores
    table = (
        np.random.default_rng(seed).standard_normal((rows_per_shard * n, dim)).astype(np.float32)
    )
    sharded = shard_table(table, topology)
    assert sharded.shape == (
        topology.global_device_count,
        topology.sparsecores_per_device * rows_per_shard,
        dim,
    )
    # Row r lives on SparseCore r mod N at local row r div N.
    shards = sharded.reshape(n, rows_per_shard, dim)
    r = np.arange(len(table))
    np.testing.assert_array_equal(shards[r % n, r // n], table)
    np.testing.assert_array_equal(unshard_table(sharded, topology), table)


def test_shard_table_requires_padded_vocabulary():
    with pytest.raises(ValueError, match="10 rows are not a multiple of the 4 SparseCores"):
        shard_table(np.zeros((10, 8)), Topology.cpu(1, 4))


table_shapes = st.lists(st.tuples(st.integers(1, 70), st.integers(1, 20)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(TOPOLOGIES, table_shapes, st.sampled_from([None, 0, 1, 3]), st.integers(0, 2**31 - 1))
def test_stack_and_shard_round_trip(devices_and_scs, shapes, rotation, seed):
    topology = Topology.cpu(*devices_and_scs)
    rng = np.random.default_rng(seed)
    specs = [TableSpec(f"t{i}", vocab, dim) for i, (vocab, dim) in enumerate(shapes)]
    features = [FeatureSpec(f"f{i}", s, topology.num_sparsecores) for i, s in enumerate(specs)]
    (stack,) = stack_tables(
        features, topology, [StackGroup(tuple(s.name for s in specs), rotation=rotation)]
    )
    tables = {
        s.name: rng.standard_normal((s.vocabulary_size, s.embedding_dim)).astype(np.float32)
        for s in specs
    }
    row_slots = {s.name: rng.random(s.vocabulary_size).astype(np.float32) for s in specs}
    stacked = stack_and_shard(stack, tables)
    assert stacked.shape == (topology.num_sparsecores, stack.rows_per_shard, stack.embedding_dim)
    back = unshard_and_unstack(stack, stacked.reshape(-1, stack.embedding_dim))
    for name, table in tables.items():
        np.testing.assert_array_equal(back[name], table)
        rows = physical_row_ids(stack, name)
        np.testing.assert_array_equal(
            stacked.reshape(-1, stack.embedding_dim)[rows, : table.shape[1]], table
        )
    # Every slot not holding a table value is padding.
    assert np.isnan(stacked).sum() == stacked.size - sum(t.size for t in tables.values())
    # Row-wise optimizer slots share the row layout.
    stacked_slots = stack_and_shard(stack, row_slots, pad_value=0.0, per_row=True)
    assert stacked_slots.shape == (topology.num_sparsecores, stack.rows_per_shard)
    for name, slot in unshard_and_unstack(stack, stacked_slots, per_row=True).items():
        np.testing.assert_array_equal(slot, row_slots[name])
        np.testing.assert_array_equal(
            stacked_slots.reshape(-1)[physical_row_ids(stack, name)], row_slots[name]
        )
    column_slots = {k: v[:, None] for k, v in row_slots.items()}
    assert stack_and_shard(stack, column_slots, per_row=True).shape[-1] == 1


def test_stack_and_shard_checks_values():
    topology = Topology.cpu(1, 4)
    specs = [TableSpec("a", 30, 8), TableSpec("b", 20, 4)]
    (stack,) = stack_tables(
        [FeatureSpec("fa", specs[0], 4), FeatureSpec("fb", specs[1], 4)],
        topology,
        [StackGroup(("a", "b"))],
    )
    with pytest.raises(ValueError, match=r"missing values for \['b'\], unexpected \['c'\]"):
        stack_and_shard(stack, {"a": np.zeros((30, 8)), "c": np.zeros((20, 4))})
    with pytest.raises(
        ValueError, match=r"table 'b': expected \[V, dim\] = \(20, 4\), got shape \(20, 5\)"
    ):
        stack_and_shard(stack, {"a": np.zeros((30, 8)), "b": np.zeros((20, 5))})
    with pytest.raises(ValueError, match="expected \\[V\\] or \\[V, 1\\]"):
        stack_and_shard(stack, {"a": np.zeros((30, 2)), "b": np.zeros((20, 2))}, per_row=True)
    with pytest.raises(ValueError, match="expected \\[4, 16, ...\\] or \\[64, ...\\]"):
        unshard_and_unstack(stack, np.zeros((4, 15, 8)))


def test_a_row_wise_optimizer_stacks_tables_of_one_dim_padded_or_not():
    """A row-wise slot averages over the table's own dim (as FBGEMM's), so a table narrower than
    the chip's alignment stacks padded, its own dim kept as the stack's logical dim; tables of
    different dims cannot share its stack (under Adagrad they can), and auto-stacking keeps them
    apart."""
    topology = Topology.cpu(1, 4)
    for dim in (4, 12):
        (stack,) = stack_tables([FeatureSpec("f", TableSpec("a", 32, dim, optimizer=RowWiseAdagrad()), 4)], topology)
        assert (stack.embedding_dim, stack.logical_embedding_dim) == (round_up(dim, 8), dim)
    specs = [TableSpec(name, 32, dim, optimizer=RowWiseAdagrad()) for name, dim in zip("abc", (12, 16, 12))]
    features = [FeatureSpec(f"f{s.name}", s, 4) for s in specs]
    with pytest.raises(ValueError, match=r"stack 'a_b': table 'b' has dim 16 but 'a' has 12; RowWiseAdagrad's row-wise"):
        stack_tables(features, topology, [StackGroup(("a", "b"))])
    assert [g.tables for g in auto_stack_groups(features, topology)] == [("a", "c"), ("b",)]
    (stack, _) = auto_stack_tables(features, topology)
    assert (stack.embedding_dim, stack.logical_embedding_dim) == (16, 12)
    specs = [TableSpec(name, 32, dim, optimizer=Adagrad()) for name, dim in zip("ab", (4, 16))]
    (stack,) = stack_tables([FeatureSpec(f"f{s.name}", s, 4) for s in specs], topology, [StackGroup(("a", "b"))])
    assert (stack.embedding_dim, stack.logical_embedding_dim) == (16, 16)


def test_stacking_offsets_rotation_and_feature_placement():
    topology = Topology.cpu(2, 2)  # N = 4, rotation defaults to 2
    a, b, c = TableSpec("a", 100, 8), TableSpec("b", 10, 8), TableSpec("c", 64, 6)
    features = {
        "z": FeatureSpec("z", a, 16),
        "y": FeatureSpec("y", b, 8),
        "x": FeatureSpec("x", c, 4, max_sequence_length=3),
        "w": FeatureSpec("w", a, 8),
    }
    assert [f.name for f in flatten_features(features)] == ["w", "x", "y", "z"]
    (stack,) = stack_tables(features, topology, [StackGroup(("a", "b", "c"))])
    assert stack.name == "a_b_c"
    assert [
        (t.padded_vocabulary_size, t.row_offset_in_shard, t.shard_rotation) for t in stack.tables
    ] == [(128, 0, 0), (32, 32, 2), (64, 40, 0)]
    assert (stack.vocabulary_size, stack.rows_per_shard, stack.embedding_dim) == (224, 56, 8)
    assert [(f.feature.name, f.row_offset, f.col_offset, f.col_shift) for f in stack.features] == [
        ("w", 0, 0, 0),
        ("x", 8, 160, 0),
        ("y", 20, 128, 2),
        ("z", 28, 0, 0),
    ]
    assert [(f.samples_per_sparsecore, f.sample_offset_in_sparsecore) for f in stack.features] == [
        (2, 0),
        (3, 2),
        (2, 5),
        (4, 7),
    ]
    assert (stack.total_sample_count, stack.batch_size_per_sparsecore) == (44, 11)
    shard, local = shard_and_local_row(stack, "b", np.array([0, 1, 5, 9]))
    np.testing.assert_array_equal(shard, [2, 3, 3, 3])
    np.testing.assert_array_equal(local, [32, 32, 33, 34])


def test_stack_keeps_per_table_limits_and_sums_them_by_default():
    topology = Topology.cpu(1, 4)
    a = TableSpec(
        "a",
        40,
        8,
        max_ids_per_partition=30,
        max_unique_ids_per_partition=10,
        suggested_coo_buffer_size_per_device=64,
    )
    b = TableSpec(
        "b",
        40,
        8,
        max_ids_per_partition=50,
        max_unique_ids_per_partition=20,
        suggested_coo_buffer_size_per_device=96,
    )
    features = [FeatureSpec("fa", a, 8), FeatureSpec("fb", b, 8)]
    (stack,) = stack_tables(features, topology, [StackGroup(("a", "b"))])
    assert (stack.max_ids_per_partition, stack.max_unique_ids_per_partition) == (80, 30)
    assert stack.suggested_coo_buffer_size_per_device == 160
    assert [
        (t.table.max_ids_per_partition, t.table.max_unique_ids_per_partition) for t in stack.tables
    ] == [(30, 10), (50, 20)]
    (overridden,) = stack_tables(
        features, topology, [StackGroup(("a", "b"), max_ids_per_partition=7)]
    )
    assert (overridden.max_ids_per_partition, overridden.tables[1].table.max_ids_per_partition) == (
        7,
        50,
    )
    alone = stack_tables(features, topology)
    assert [
        (s.name, s.max_ids_per_partition, s.suggested_coo_buffer_size_per_device) for s in alone
    ] == [("a", 30, 64), ("b", 50, 96)]
    updated = stack.with_limits(9, 8, None, {"b": (5, 4)})
    assert [t.table.max_ids_per_partition for t in updated.tables] == [30, 5]
    assert updated.features[1].feature.table.max_ids_per_partition == 5


def test_auto_stacking_groups_by_padded_dim_optimizer_and_combiner_in_first_use_order():
    topology = Topology.cpu(1, 4)
    tables = [
        TableSpec("zeta", 64, 8),
        TableSpec("alpha", 64, 6),  # pads to 8: stacks with zeta
        TableSpec("wide", 64, 16),
        TableSpec("mean", 64, 8, combiner="mean"),
        TableSpec("ada", 64, 8, optimizer=Adagrad()),
        TableSpec("slow", 64, 8, optimizer=SGD(learning_rate=0.5)),
        TableSpec("beta", 64, 8),
    ]
    features = {f"f{i}": FeatureSpec(f"f{i}", t, 8) for i, t in enumerate(tables)}
    groups = auto_stack_groups(features, topology)
    assert [g.tables for g in groups] == [
        ("zeta", "alpha", "beta"),
        ("wide",),
        ("mean",),
        ("ada",),
        ("slow",),
    ]
    assert [s.name for s in auto_stack_tables(features, topology)] == [
        "zeta_alpha_beta",
        "wide",
        "mean",
        "ada",
        "slow",
    ]


def test_auto_stacking_splits_at_the_activation_memory_limit_first_fit():
    topology = Topology.cpu(1, 4)
    # Activation bytes per SparseCore = padded dim 8 * (batch / 4) * 4 bytes.
    batches = [64, 32, 64, 32, 16]  # 512, 256, 512, 256, 128 bytes
    tables = [TableSpec(f"t{i}", 64, 8) for i in range(len(batches))]
    features = [FeatureSpec(f"f{i}", t, b) for i, (t, b) in enumerate(zip(tables, batches))]
    groups = auto_stack_groups(features, topology, activation_memory_limit_bytes=800)
    assert [g.tables for g in groups] == [("t0", "t1"), ("t2", "t3"), ("t4",)]
    groups = auto_stack_groups(features, topology, activation_memory_limit_bytes=100)
    assert [g.tables for g in groups] == [(f"t{i}",) for i in range(5)]


def test_alignment_comes_from_the_chip():
    tables = [TableSpec("a", 64, 12), TableSpec("b", 64, 16)]
    features = [FeatureSpec("fa", tables[0], 16), FeatureSpec("fb", tables[1], 16)]
    assert len(auto_stack_groups(features, Topology.cpu(1, 2))) == 1
    v6e = Topology.preset("v6e", 2)
    (stack,) = stack_tables(features[:1], v6e)
    assert stack.embedding_dim == 16
    assert len(auto_stack_groups(features, v6e)) == 1


@pytest.mark.parametrize(
    "groups, match",
    [
        ([StackGroup(("a", "m"))], "table 'm' uses combiner 'mean' but 'a' uses 'sum'"),
        ([StackGroup(("a", "o"))], "table 'o' uses optimizer Adagrad"),
        ([StackGroup(("a", "nope"))], "no feature reads table 'nope'"),
        ([StackGroup(("a",)), StackGroup(("a", "b"))], "table 'a' is in two stack groups"),
        ([StackGroup(("a",), name="b")], r"stack name\(s\) \['b'\] used more than once"),
    ],
)
def test_stacking_errors(groups, match):
    tables = [
        TableSpec("a", 8, 8),
        TableSpec("b", 8, 8),
        TableSpec("m", 8, 8, combiner="mean"),
        TableSpec("o", 8, 8, optimizer="adagrad"),
    ]
    features = [FeatureSpec(f"f_{t.name}", t, 4) for t in tables]
    with pytest.raises(ValueError, match=match):
        stack_tables(features, Topology.cpu(1, 4), groups)


def test_stack_group_rejects_repeats_and_non_positive_limits():
    with pytest.raises(ValueError, match=r"table\(s\) \['a'\] repeated"):
        StackGroup(("a", "b", "a"))
    with pytest.raises(ValueError, match="max_ids_per_partition must be positive, got 0"):
        StackGroup(("a",), max_ids_per_partition=0)


def test_feature_errors():
    table = TableSpec("t", 8, 8)
    topology = Topology.cpu(2, 4)
    with pytest.raises(ValueError, match=r"feature name\(s\) \['f'\] used more than once"):
        stack_tables([FeatureSpec("f", table, 8), FeatureSpec("f", table, 8)], topology)
    with pytest.raises(ValueError, match="two different tables are named 't'"):
        stack_tables(
            [FeatureSpec("f", table, 8), FeatureSpec("g", TableSpec("t", 9, 8), 8)], topology
        )
    with pytest.raises(
        ValueError,
        match="feature 'f': its 12 output rows per step cannot be split evenly over the 8",
    ):
        stack_tables([FeatureSpec("f", table, 12)], topology)
    with pytest.raises(ValueError, match="feature 's': its 20 output rows"):
        stack_tables([FeatureSpec("s", table, 4, max_sequence_length=5)], topology)


def test_stack_too_large_for_int32_buffers_is_rejected():
    huge = TableSpec("huge", 2**33, 8)
    with pytest.raises(ValueError, match="stack 'huge': 2147483648 rows per shard do not fit"):
        stack_tables([FeatureSpec("f", huge, 4)], Topology.cpu(1, 4))


def test_features_must_fill_each_sparsecore_batch_in_order():
    """Each SparseCore's batch holds the features' samples one after another, in order: a stack
    whose placements say otherwise is rejected (the torch modules regroup activations by it)."""
    import dataclasses

    tables = [TableSpec("a", 64, 8), TableSpec("b", 64, 8)]
    features = [FeatureSpec("fa", tables[0], 8), FeatureSpec("fb", tables[1], 8)]
    (stack,) = stack_tables(features, Topology.cpu(1, 2), [StackGroup(("a", "b"))])
    assert [p.sample_offset_in_sparsecore for p in stack.features] == [0, 4]
    with pytest.raises(ValueError, match="feature 'fb' starts at sample 4 .* expected 0"):
        dataclasses.replace(stack, features=stack.features[::-1])
    with pytest.raises(ValueError, match="its features fill 4 samples of each SparseCore's batch of 8"):
        short = dataclasses.replace(stack.features[1], samples_per_sparsecore=0)
        dataclasses.replace(stack, features=(stack.features[0], short))
