"""Host preprocessing: every bad input raises a named error, dtypes are read as given, limits
raise or drop and count, stats feed `update_limits`, and the unique-row side-car is consistent."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from _reference_model import preprocess_model
from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import (
    PAD_ID,
    BufferOverflowError,
    PartitionLimitError,
    RaggedIds,
    pipeline,
    preprocess,
    preprocess_stack,
    update_limits,
)
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

# Every test here runs with each host-preprocessing implementation (tests/sparsecore/conftest.py).
pytestmark = pytest.mark.usefixtures("each_preprocess_implementation")

TOPOLOGY = Topology.cpu(1, 2)


def one_stack(combiner="sum", vocab=64, batch=4, topology=TOPOLOGY, **table_kwargs):
    table = TableSpec("t", vocab, 8, combiner=combiner, **table_kwargs)
    return stack_tables([FeatureSpec("f", table, batch)], topology)


def run(ids: RaggedIds, stacks=None, topology=TOPOLOGY, **kwargs):
    return preprocess(stacks or one_stack(), {"f": ids}, topology, **kwargs)


def lengths_input(values, lengths, weights=None):
    return RaggedIds(np.asarray(values), lengths=np.asarray(lengths), weights=weights)


@pytest.mark.parametrize(
    "ids, match",
    [
        (
            lengths_input([1, 64], [1, 1, 0, 0]),
            r"feature 'f': id 64 \(position 1\) is outside the vocabulary \[0, 64\) of table 't'",
        ),
        (
            lengths_input([-3, 1], [1, 1, 0, 0]),
            r"feature 'f': id -3 \(position 0\) is outside the vocabulary",
        ),
        (lengths_input([1, 2], [3, -1, 0, 0]), "feature 'f': sample 1 has negative length -1"),
        (
            lengths_input([1, 2], [1, 0, 0, 0]),
            "feature 'f': lengths sum to 1 but there are 2 values",
        ),
        (
            lengths_input([1, 2], [1, 1, 0]),
            "feature 'f': expected 4 samples on this host, got 3 lengths",
        ),
        (
            lengths_input([1.0, 2.0], [1, 1, 0, 0]),
            "feature 'f': ids must be a 1-D integer array, got float64",
        ),
        (lengths_input([[1, 2]], [1, 1, 0, 0]), "feature 'f': ids must be a 1-D integer array"),
        (
            lengths_input([1, 2], [1.0, 1.0, 0, 0]),
            "feature 'f': lengths must be a 1-D integer array",
        ),
        (
            RaggedIds(np.array([1, 2]), offsets=np.array([0, 1, 2, 2])),
            "feature 'f': expected 5 offsets for 4 samples",
        ),
        (
            RaggedIds(np.array([1, 2]), offsets=np.array([1, 1, 2, 2, 2])),
            r"offsets must run from 0 to the 2 values, got 1\.\.2",
        ),
        (
            RaggedIds(np.array([1, 2]), offsets=np.array([0, 2, 1, 2, 2])),
            "sample 1 has negative length -1",
        ),
        (
            lengths_input([1, 2], [1, 1, 0, 0], np.array([1, 2])),
            "feature 'f': weights must be floats shaped like the ids",
        ),
        (
            lengths_input([1, 2], [1, 1, 0, 0], np.ones(3)),
            "feature 'f': weights must be floats shaped like the ids",
        ),
        (
            lengths_input([1, 2], [1, 1, 0, 0], np.array([1.0, np.inf])),
            "feature 'f': weight inf at position 1 is not finite",
        ),
    ],
)
def test_bad_input_is_rejected_naming_the_feature(ids, match):
    with pytest.raises(ValueError, match=match):
        run(ids)


@pytest.mark.parametrize("sequence", [None, 3])
def test_an_id_outside_the_vocabulary_is_rejected_wherever_its_sample_lands(sequence):
    # 2 devices x 2 SparseCores: the bad id belongs to the last sample, on device 1, SparseCore 1.
    topology = Topology.cpu(2, 2)
    table = TableSpec("t", 64, 8)
    stacks = stack_tables([FeatureSpec("f", table, 8, max_sequence_length=sequence)], topology)
    ids = lengths_input([5, 7, 64], [1, 0, 0, 0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"feature 'f': id 64 \(position 2\) is outside the vocabulary"):
        preprocess(stacks, {"f": ids}, topology)


def test_ragged_ids_needs_exactly_one_split():
    with pytest.raises(ValueError, match="exactly one of `lengths` and `offsets`"):
        RaggedIds(np.array([1]))
    with pytest.raises(ValueError, match="exactly one of `lengths` and `offsets`"):
        RaggedIds(np.array([1]), lengths=np.array([1]), offsets=np.array([0, 1]))


@pytest.mark.parametrize(
    "combiner, weights, match",
    [
        (
            "mean",
            [1.0, -1.0, 2.0],
            "feature 'f': sample 0 has 2 id\\(s\\) whose sum of weights is 0, so its mean",
        ),
        (
            "sqrtn",
            [0.0, 0.0, 2.0],
            "sample 0 has 2 id\\(s\\) whose sum of squared weights is 0, so its sqrtn",
        ),
    ],
)
def test_undefined_combiner_divisor_is_an_error(combiner, weights, match):
    ids = lengths_input([1, 2, 3], [2, 1, 0, 0], np.array(weights, np.float32))
    with pytest.raises(ValueError, match=match):
        run(ids, one_stack(combiner))


def test_missing_and_unknown_feature_inputs():
    stacks = one_stack()
    with pytest.raises(ValueError, match=r"stack 't': no input for feature\(s\) \['f'\]"):
        preprocess(stacks, {}, TOPOLOGY)
    ids = lengths_input([1], [1, 0, 0, 0])
    with pytest.raises(ValueError, match=r"input for unknown feature\(s\) \['g'\]"):
        preprocess(stacks, {"f": ids, "g": ids}, TOPOLOGY)


def test_stack_for_another_topology_is_rejected():
    with pytest.raises(ValueError, match="laid out for 2 SparseCores but the topology has 4"):
        preprocess(one_stack(), {"f": lengths_input([1], [1, 0, 0, 0])}, Topology.cpu(1, 4))


def test_sequence_longer_than_its_maximum_is_rejected():
    table = TableSpec("t", 64, 8)
    stacks = stack_tables([FeatureSpec("f", table, 2, max_sequence_length=2)], TOPOLOGY)
    with pytest.raises(
        ValueError, match="feature 'f': sample 1 has 3 ids, more than its max_sequence_length 2"
    ):
        preprocess(stacks, {"f": lengths_input([1, 2, 3, 4], [1, 3])}, TOPOLOGY)


def test_sequence_feature_gives_each_position_its_own_row_and_its_weight_as_gain():
    table = TableSpec("t", 64, 8, combiner="mean")
    stacks = stack_tables([FeatureSpec("f", table, 2, max_sequence_length=3)], TOPOLOGY)
    ids = lengths_input([4, 4, 7], [2, 1], np.array([0.5, 0.25, 2.0], np.float32))
    batch = preprocess(stacks, {"f": ids}, TOPOLOGY)["t"]
    # Rows: sample 0 -> rows 0, 1; sample 1 -> row 3. Three rows per SparseCore.
    segment = batch.sizes.coo_buffer_size_per_sparsecore
    assert batch.row_pointers[0, :2].tolist() == [2, 8]
    assert list(zip(batch.embedding_ids[0, :2], batch.sample_ids[0, :2], batch.gains[0, :2])) == [
        (2, 0, 0.5),
        (2, 1, 0.25),
    ]
    assert batch.row_pointers[0, 8:10].tolist() == [0, 1]
    assert (
        batch.embedding_ids[0, segment],
        batch.sample_ids[0, segment],
        batch.gains[0, segment],
    ) == (3, 0, 2.0)


def test_int64_ids_beyond_int32_and_float64_weights_are_read_as_such():
    topology = Topology.cpu(1, 8)
    table = TableSpec("big", 2**33, 8)
    stacks = stack_tables([FeatureSpec("f", table, 8)], topology)
    values = np.array([2**33 - 3, 2**32 + 13, 7], dtype=np.int64)
    weights = np.array([0.1, 1e-3, 3.0], dtype=np.float64)
    batch = preprocess(
        stacks, {"f": lengths_input(values, [3, 0, 0, 0, 0, 0, 0, 0], weights)}, topology
    )["big"]
    entries = [(int(p), int(e), float(g)) for p, e, g in decode_single_sparsecore(batch, 0, 0)]
    assert sorted(entries) == sorted(
        [
            (5, (2**33 - 3) // 8, float(np.float32(0.1))),
            (5, (2**32 + 13) // 8, float(np.float32(1e-3))),
            (7, 0, 3.0),
        ]
    )


def decode_single_sparsecore(batch, device, sparsecore):
    """(partition, embedding id, gain) of every real entry of one SparseCore's segment."""
    r = batch.sizes.row_pointers_per_sparsecore
    segment = batch.sizes.coo_buffer_size_per_sparsecore
    pointers = batch.row_pointers[device, sparsecore * r : (sparsecore + 1) * r]
    entries, start = [], 0
    for p, end in enumerate(pointers[: batch.stats.max_ids_per_partition.shape[1]]):
        for i in range(start, end):
            slot = sparsecore * segment + i
            entries.append((p, batch.embedding_ids[device, slot], batch.gains[device, slot]))
        start = (end + 7) // 8 * 8
    return entries


def test_float64_and_float32_weights_give_the_same_gains():
    values = np.array([1, 3, 3, 5])
    w64 = np.array([0.1, 0.7, 1 / 3, 2.5])
    a = run(lengths_input(values, [4, 0, 0, 0], w64), one_stack("sqrtn"))["t"]
    b = run(lengths_input(values, [4, 0, 0, 0], w64.astype(np.float32)), one_stack("sqrtn"))["t"]
    np.testing.assert_array_equal(a.gains, b.gains)


def two_feature_stack(max_ids=8, max_unique=8, **group):
    topology = Topology.cpu(1, 2)
    a, b = TableSpec("a", 64, 8), TableSpec("b", 32, 8)
    features = [FeatureSpec("fa", a, 4), FeatureSpec("fb", b, 4)]
    stacks = stack_tables(
        features,
        topology,
        [
            StackGroup(
                ("a", "b"),
                max_ids_per_partition=max_ids,
                max_unique_ids_per_partition=max_unique,
                **group,
            )
        ],
    )
    return stacks, topology


def test_limit_error_names_stack_tables_features_observed_and_configured():
    stacks, topology = two_feature_stack(max_unique=2)
    inputs = {
        "fa": lengths_input([0, 2, 4, 6], [4, 0, 0, 0]),  # partition 0, four distinct rows
        "fb": lengths_input([1], [0, 0, 1, 0]),  # SparseCore 1, partition 1 (rotation 2 mod 2)
    }
    with pytest.raises(PartitionLimitError) as error:
        preprocess(stacks, inputs, topology)
    assert (error.value.limit, error.value.observed, error.value.configured) == (
        "max_unique_ids_per_partition",
        4,
        2,
    )
    assert (error.value.device, error.value.sparsecore, error.value.partition) == (0, 0, 0)
    assert error.value.features == ("fa",)
    assert "stacked table 'a_b' (tables a, b; features fa)" in str(error.value)
    batch = preprocess(stacks, inputs, topology, allow_id_dropping=True)["a_b"]
    assert batch.stats.id_drop_count == 2
    assert batch.stats.max_unique_ids_per_partition.tolist() == [[4, 1]]
    assert batch.row_pointers[0, :2].tolist() == [2, 8]


def test_buffer_overflow_raises_or_drops_and_counts():
    # 2 SparseCores per device: the suggested 8 slots round up to 16, i.e. 8 per SparseCore.
    stacks = one_stack(batch=2, suggested_coo_buffer_size_per_device=8)
    ids = lengths_input(np.arange(0, 40, 2), [20, 0])  # 20 rows of partition 0 on SparseCore 0
    with pytest.raises(
        BufferOverflowError, match=r"SparseCore 0 needs 24 COO slots but its segment holds 8"
    ):
        run(ids, stacks)
    batch = run(ids, stacks, allow_id_dropping=True)["t"]
    assert batch.sizes.coo_buffer_size_per_device == 16
    assert batch.stats.id_drop_count == 12
    assert batch.stats.max_ids_per_partition.tolist() == [[20, 0]]
    assert batch.row_pointers[0].tolist() == [8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0]
    assert batch.embedding_ids[0, :8].tolist() == list(range(8))


def test_per_table_stats_and_update_limits():
    stacks, topology = two_feature_stack(max_ids=64, max_unique=64)
    inputs = {
        "fa": lengths_input([0, 0, 2, 4, 6, 8], [2, 2, 1, 1]),
        "fb": lengths_input([1, 3, 3], [0, 2, 1, 0]),
    }
    (stack,) = stacks
    stats = preprocess(stacks, inputs, topology)["a_b"].stats
    # SparseCore 0, partition 0: table a's pairs (0, id 0), (1, id 2), (1, id 4); partition 1:
    # table b's (1, id 1), (1, id 3). SparseCore 1 has 2 and 1.
    assert stats.max_ids_per_partition.tolist() == [[3, 2]]
    assert stats.table_max_ids_per_partition == {"a": 3, "b": 2}
    assert stats.table_max_unique_ids_per_partition == {"a": 3, "b": 2}
    updated = update_limits(stack, stats, margin=1.5)
    assert (updated.max_ids_per_partition, updated.max_unique_ids_per_partition) == (5, 5)
    assert [
        (t.table.max_ids_per_partition, t.table.max_unique_ids_per_partition)
        for t in updated.tables
    ] == [(5, 5), (3, 3)]
    assert updated.suggested_coo_buffer_size_per_device == 2 * 24
    again = preprocess((updated,), inputs, topology)["a_b"]
    np.testing.assert_array_equal(again.stats.max_ids_per_partition, stats.max_ids_per_partition)
    merged = stats.merge(again.stats)
    assert merged.table_max_ids_per_partition == stats.table_max_ids_per_partition
    with pytest.raises(ValueError, match="margin must be >= 1.0"):
        update_limits(stack, stats, margin=0.9)


def test_unique_rows_side_car_is_consistent_with_the_buffers():
    topology = Topology.cpu(2, 2)
    rng = np.random.default_rng(3)
    table = TableSpec("t", 200, 8, max_ids_per_partition=6, max_unique_ids_per_partition=3)
    stacks = stack_tables([FeatureSpec("f", table, 32)], topology)
    lengths = rng.integers(0, 6, 32)
    ids = lengths_input(rng.integers(0, 40, lengths.sum()), lengths)
    for dropping in (True,):
        batch = preprocess(stacks, {"f": ids}, topology, allow_id_dropping=dropping)["t"]
        unique = batch.unique
        n, width = 4, batch.sizes.unique_rows_per_partition
        assert width == 8 and unique.unique_ids.shape == (2, n, width)
        assert batch.stats.id_drop_count > 0
        for d in range(2):
            real = batch.embedding_ids[d] != PAD_ID
            flat = unique.unique_ids[d].reshape(-1)
            np.testing.assert_array_equal(
                flat[unique.entry_unique_index[d, real]], batch.embedding_ids[d, real]
            )
            assert np.all(unique.entry_unique_index[d, ~real] == PAD_ID)
            for p in range(n):
                count = unique.unique_counts[d, p]
                rows = unique.unique_ids[d, p, :count]
                assert np.all(np.diff(rows) > 0) and np.all(
                    unique.unique_ids[d, p, count:] == PAD_ID
                )
                in_partition = (unique.entry_unique_index[d] // width == p) & real
                assert set(batch.embedding_ids[d, in_partition]) == set(rows)
    without = preprocess(
        stacks, {"f": ids}, topology, allow_id_dropping=True, with_unique_rows=False
    )["t"]
    assert without.unique is None
    np.testing.assert_array_equal(without.embedding_ids, batch.embedding_ids)


def test_threads_give_identical_results():
    topology = Topology.cpu(2, 4)
    rng = np.random.default_rng(0)
    tables = [
        TableSpec(f"t{i}", 500, 8, combiner=c) for i, c in enumerate(["sum", "mean", "sqrtn"])
    ]
    features = [FeatureSpec(f"f{i}", t, 64) for i, t in enumerate(tables)]
    stacks = stack_tables(features, topology)
    inputs = {}
    for f in features:
        lengths = rng.integers(0, 5, 64)
        inputs[f.name] = lengths_input(
            rng.integers(0, 500, lengths.sum()),
            lengths,
            rng.random(lengths.sum()).astype(np.float32) + 0.5,
        )
    one = preprocess(stacks, inputs, topology, num_threads=1)
    two = preprocess(stacks, inputs, topology, num_threads=2)
    for name in one:
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            np.testing.assert_array_equal(getattr(one[name], field), getattr(two[name], field))


def test_preprocess_stack_matches_reference_model_with_offsets_input():
    rng = np.random.default_rng(7)
    stacks = one_stack("mean", vocab=50, batch=8, topology=Topology.cpu(1, 4))
    lengths = rng.integers(0, 7, 8)
    values = rng.integers(0, 50, lengths.sum()).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    batch = preprocess_stack(
        stacks[0], {"f": RaggedIds(values, offsets=offsets)}, Topology.cpu(1, 4)
    )
    split = np.split(values, offsets[1:-1])
    model = preprocess_model(
        stacks[0],
        {"f": (split, None)},
        Topology.cpu(1, 4),
        False,
        batch.sizes.coo_buffer_size_per_device,
    )
    np.testing.assert_array_equal(batch.row_pointers, model.row_pointers)
    np.testing.assert_array_equal(batch.gains, model.gains)


def test_a_batch_without_ids_gives_empty_buffers_and_zero_stats():
    topology = Topology.cpu(2, 2)
    stacks = one_stack(topology=topology, batch=8)
    batch = preprocess(
        stacks, {"f": lengths_input(np.zeros(0, np.int64), np.zeros(8, int))}, topology
    )["t"]
    assert not batch.row_pointers.any()
    assert np.all(batch.embedding_ids == PAD_ID) and np.all(np.isnan(batch.gains))
    assert not batch.stats.max_ids_per_partition.any() and batch.stats.id_drop_count == 0
    assert not batch.unique.unique_counts.any()


def test_package_attribute_is_the_preprocess_module_not_the_function():
    import sparsecore

    assert sparsecore.preprocess.preprocess is preprocess
    assert sparsecore.RaggedIds is RaggedIds


@pytest.mark.parametrize("with_unique_rows", [True, False])
def test_errors_name_the_absolute_device_and_sparsecore_when_chunked(with_unique_rows):
    topology = Topology.cpu(2, 2)
    stacks = one_stack(topology=topology, batch=8, max_ids_per_partition=2)
    lengths = [0, 0, 0, 0, 0, 0, 3, 0]  # sample 6: device 1, SparseCore 1
    ids = lengths_input([0, 4, 8], lengths)
    with mock.patch.object(pipeline, "CHUNK_IDS", 1):
        with pytest.raises(PartitionLimitError) as error:
            preprocess(stacks, {"f": ids}, topology, with_unique_rows=with_unique_rows)
    assert (error.value.device, error.value.sparsecore, error.value.partition) == (1, 1, 0)
    stacks = one_stack(topology=topology, batch=8, suggested_coo_buffer_size_per_device=16)
    with mock.patch.object(pipeline, "CHUNK_IDS", 1):
        with pytest.raises(BufferOverflowError) as overflow:
            preprocess(stacks, {"f": lengths_input(np.arange(0, 40, 4), [0] * 7 + [10])}, topology)
    assert (overflow.value.device, overflow.value.sparsecore) == (1, 1)
