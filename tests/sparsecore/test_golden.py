"""Conformance with jax-tpu-embedding 0.2.0's buffers, stats and layouts (committed golden data).

Every preprocessing case must match exactly (row pointers, every defined slot, gains bit for
bit, stats, drop counts), except where the reference is wrong and this project does better:
p29 and p43 raise Python exceptions naming the problem (the reference aborts or raises), p35
raises unless dropping is on (the reference drops silently), p45 reads int64 ids correctly (the
reference misreads them).
"""

from __future__ import annotations

import numpy as np
import pytest

import _golden_cases as golden
from _reference_model import preprocess_model
from sparsecore.layout import (
    physical_row_ids,
    shard_table,
    stack_and_shard,
    stack_tables,
    StackGroup,
    unshard_and_unstack,
    unshard_table,
)
from sparsecore.preprocess import (
    BufferOverflowError,
    PartitionLimitError,
    RaggedIds,
    preprocess,
    update_limits,
)
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

# Every test here runs with each host-preprocessing implementation (tests/sparsecore/conftest.py).
pytestmark = pytest.mark.usefixtures("each_preprocess_implementation")

CONFORMANCE_OK = [
    name
    for name in golden.names("preprocess", status="ok", conformance_case=True)
    if not name.startswith("p35")
]


def run(
    name: str,
    allow_id_dropping: bool | None = None,
    stack_limits: str = "recorded",
    with_unique_rows: bool = True,
):
    c = golden.case(name)
    dropping = c["allow_id_dropping"] if allow_id_dropping is None else allow_id_dropping
    stacks = golden.stacks(name, stack_limits)
    return preprocess(
        stacks,
        golden.inputs(name),
        golden.topology(name),
        allow_id_dropping=dropping,
        with_unique_rows=with_unique_rows,
    )


def assert_same_float32_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit for bit, except that any NaN matches any NaN (pads)."""
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    np.testing.assert_array_equal(actual[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def assert_buffers_match(
    name: str, stack: str, row_pointers, embedding_ids, sample_ids, gains
) -> None:
    """Row pointers exactly; embedding ids, sample ids and gains in every defined slot."""
    c = golden.case(name)
    outputs = golden.npz(name, "outputs.npz")
    segment = c["buffers"][stack]["coo_buffer_size_per_sc"]
    for d in range(c["topology"]["local_device_count"]):
        prefix = f"{stack}/dev{d}"
        np.testing.assert_array_equal(row_pointers[d], outputs[f"{prefix}/row_pointers"])
        for s, defined in enumerate(outputs[f"{prefix}/defined_len"]):
            region = slice(s * segment, s * segment + defined)
            np.testing.assert_array_equal(
                embedding_ids[d, region], outputs[f"{prefix}/embedding_ids"][region]
            )
            np.testing.assert_array_equal(
                sample_ids[d, region], outputs[f"{prefix}/sample_ids"][region]
            )
            assert_same_float32_bits(gains[d, region], outputs[f"{prefix}/gains"][region])


def assert_matches_outputs(name: str, batches) -> None:
    c = golden.case(name)
    assert sorted(batches) == sorted(c["buffers"])
    for stack, expected_sizes in c["buffers"].items():
        batch = batches[stack]
        assert (
            batch.sizes.row_pointers_size_per_device
            == expected_sizes["row_pointers_size_per_device"]
        )
        assert (
            batch.sizes.coo_buffer_size_per_device == expected_sizes["coo_buffer_size_per_device"]
        )
        assert batch.sizes.batch_size_per_sparsecore == expected_sizes["batch_size_per_sc"]
        assert_buffers_match(
            name, stack, batch.row_pointers, batch.embedding_ids, batch.sample_ids, batch.gains
        )
        stats = c["stats"][stack]
        np.testing.assert_array_equal(
            batch.stats.max_ids_per_partition.reshape(-1), stats["max_ids_per_partition"]
        )
        np.testing.assert_array_equal(
            batch.stats.max_unique_ids_per_partition.reshape(-1),
            stats["max_unique_ids_per_partition"],
        )
        np.testing.assert_array_equal(
            batch.stats.required_buffer_size_per_sparsecore.reshape(-1),
            stats["required_buffer_size_per_sc"],
        )
        assert (
            batch.stats.required_buffer_size_per_device == stats["required_buffer_size_per_device"]
        )
        assert batch.stats.id_drop_count == stats["id_drop_counters"]


def model_inputs(name: str) -> dict:
    """The case's inputs as per-sample lists, for the test-side reference model."""
    result = {}
    for feature, ragged in golden.inputs(name).items():
        split = np.cumsum(ragged.lengths)[:-1]
        weights = None if ragged.weights is None else np.split(ragged.weights, split)
        result[feature] = (np.split(ragged.values, split), weights)
    return result


@pytest.mark.parametrize("with_unique_rows", [True, False])
@pytest.mark.parametrize("name", CONFORMANCE_OK)
def test_conformance_buffers_and_stats(name, with_unique_rows):
    assert_matches_outputs(name, run(name, with_unique_rows=with_unique_rows))


@pytest.mark.parametrize("name", CONFORMANCE_OK)
def test_stacking_decisions_match_library(name):
    """Stack membership, order, padding, offsets, rotations and feature placement."""
    stacks = {s.name: s for s in golden.stacks(name)}
    recorded = golden.case(name)["stacking"]["stacked_tables"]
    assert sorted(stacks) == sorted(s["stack_name"] for s in recorded)
    for expected in recorded:
        stack = stacks[expected["stack_name"]]
        assert stack.vocabulary_size == expected["stack_vocab_size"]
        assert stack.embedding_dim == expected["stack_embedding_dim"]
        assert stack.combiner.value == expected["combiner"]
        assert stack.total_sample_count == expected["total_sample_count"]
        assert stack.batch_size_per_sparsecore == expected["batch_size_per_sc"]
        assert [
            (p.table.name, p.padded_vocabulary_size, p.row_offset_in_shard, p.shard_rotation)
            for p in stack.tables
        ] == [
            (t["name"], t["padded_vocab_size"], t["row_offset_in_shard"], t["shard_rotation"])
            for t in expected["tables"]
        ]
        assert [
            (
                f.feature.name,
                f.row_offset,
                f.col_offset,
                f.col_shift,
                f.samples_per_sparsecore,
                f.sample_offset_in_sparsecore,
            )
            for f in stack.features
        ] == [
            (
                f["name"],
                f["row_offset"],
                f["col_offset"],
                f["col_shift"],
                f["samples_per_sc"],
                f["sample_offset_in_sc"],
            )
            for f in expected["features"]
        ]


@pytest.mark.parametrize("name", CONFORMANCE_OK)
def test_reference_model_agrees_with_golden(name):
    """The test-side model used by the randomised tests reproduces the library's buffers."""
    c = golden.case(name)
    for stack in golden.stacks(name):
        size = c["buffers"][stack.name]["coo_buffer_size_per_device"]
        model = preprocess_model(
            stack, model_inputs(name), golden.topology(name), c["allow_id_dropping"], size
        )
        assert_buffers_match(
            name, stack.name, model.row_pointers, model.embedding_ids, model.sample_ids, model.gains
        )
        assert model.dropped == c["stats"][stack.name]["id_drop_counters"]
        np.testing.assert_array_equal(
            model.max_ids.reshape(-1), c["stats"][stack.name]["max_ids_per_partition"]
        )


def test_p29_limit_exceeded_raises_naming_feature_table_observed_and_configured():
    with pytest.raises(PartitionLimitError) as error:
        run("p29_limit_max_ids_error_d1_sc2")
    message = str(error.value)
    # The reference aborts the process with "Observed max ids per partition: 20 for table: t is
    # greater than the set max ids per partition: 8".
    assert "max_ids_per_partition 20" in message and "configured max_ids_per_partition 8" in message
    assert "'t'" in message and "features f" in message
    assert (error.value.observed, error.value.configured, error.value.features) == (20, 8, ("f",))


def test_p29_input_with_dropping_is_p30():
    assert_matches_outputs(
        "p30_limit_max_ids_dropping_d1_sc2",
        run("p29_limit_max_ids_error_d1_sc2", allow_id_dropping=True),
    )


def test_p43_non_power_of_two_sparsecores_raises_value_error():
    topology = golden.case("p43_error_num_scs_not_power_of_two")["topology"]
    with pytest.raises(
        ValueError, match=r"Total number of SparseCores \(6 = 3 devices x 2 .*power of 2"
    ):
        Topology.cpu(topology["global_device_count"], topology["num_sc_per_device"])


def test_p35_undersized_buffer_raises_without_dropping():
    with pytest.raises(BufferOverflowError) as error:
        run("p35_static_buffer_overflow_d1_sc2")
    assert error.value.needed == 48 and error.value.capacity == 8
    assert "'t'" in str(error.value) and "features f" in str(error.value)


def test_p35_undersized_buffer_with_dropping_matches_reference_drops():
    assert_matches_outputs(
        "p35_static_buffer_overflow_d1_sc2", run("p35_static_buffer_overflow_d1_sc2", True)
    )


def test_p45_int64_ragged_ids_are_read_as_int64_not_reinterpreted():
    name = "p45_quirk_ragged_int64_reinterpreted_d1_sc2"
    assert golden.inputs(name)["f"].values.dtype == np.int64
    batch = run(name)["t"]
    # Samples [3, 5], [7], [9, 9, 9], [2]: SparseCore 0 gets samples 0-1, SparseCore 1 gets
    # samples 2-3 (local 0-1); partition = id mod 2, embedding id = id div 2; sum combiner.
    assert batch.row_pointers[0].tolist() == [0, 3, 8, 8, 8, 8, 8, 8, 1, 9, 16, 16, 16, 16, 16, 16]
    segment = batch.sizes.coo_buffer_size_per_sparsecore
    entries = [
        (int(batch.embedding_ids[0, i]), int(batch.sample_ids[0, i]), float(batch.gains[0, i]))
        for i in (0, 1, 2, segment, segment + 8)
    ]
    assert entries == [(1, 0, 1.0), (2, 0, 1.0), (3, 1, 1.0), (1, 1, 1.0), (4, 0, 3.0)]
    model = preprocess_model(
        golden.stacks(name)[0], model_inputs(name), golden.topology(name), False, 2 * segment
    )
    np.testing.assert_array_equal(batch.row_pointers, model.row_pointers)
    np.testing.assert_array_equal(batch.embedding_ids, model.embedding_ids)
    misread = golden.npz(name, "outputs.npz")["t/dev0/row_pointers"]
    assert not np.array_equal(batch.row_pointers[0], misread)


def test_p37_two_pass_limit_update_reproduces_library_limits():
    name = "p37_large_zipf_auto_fdo_d4_sc4"
    c = golden.case(name)
    first = run(name, stack_limits="first_pass")
    expected = c["fdo_first_pass"]["stats"]
    for stack in golden.stacks(name, "first_pass"):
        stats = first[stack.name].stats
        np.testing.assert_array_equal(
            stats.max_ids_per_partition.reshape(-1), expected["max_ids_per_partition"][stack.name]
        )
        updated = update_limits(stack, stats, margin=1.0)
        recorded = next(s for s in c["stacking"]["stacked_tables"] if s["stack_name"] == stack.name)
        assert (
            updated.max_ids_per_partition,
            updated.max_unique_ids_per_partition,
            updated.suggested_coo_buffer_size_per_device,
        ) == (
            recorded["max_ids_per_partition"],
            recorded["max_unique_ids_per_partition"],
            recorded["suggested_coo_buffer_size_per_device"],
        )


@pytest.mark.parametrize("name", golden.names("layout"))
def test_layout_cases(name):
    c = golden.case(name)
    data = golden.npz(name, "layout.npz")
    t = c["topology"]
    topology = Topology.cpu(t["global_device_count"], t["num_sc_per_device"])
    if "stacked_table" not in c:
        np.testing.assert_array_equal(shard_table(data["table/t"], topology), data["sharded"])
        np.testing.assert_array_equal(unshard_table(data["sharded"], topology), data["table/t"])
        return
    specs = [TableSpec(x["name"], x["vocabulary_size"], x["embedding_dim"]) for x in c["tables"]]
    features = [FeatureSpec(f"f_{s.name}", s, topology.num_sparsecores) for s in specs]
    group = StackGroup(
        tuple(s.name for s in specs), rotation=c["stacked_table"]["rotation_argument"]
    )
    (stack,) = stack_tables(features, topology, [group])
    assert stack.name == c["stacked_table"]["stack_name"]
    assert stack.rows_per_shard == c["stacked_table"]["rows_per_shard"]
    for expected in c["tables"]:
        placement = stack.table(expected["name"])
        assert (
            placement.padded_vocabulary_size,
            placement.row_offset_in_shard,
            placement.shard_rotation,
        ) == (
            expected["padded_vocab_size"],
            expected["row_offset_in_shard"],
            expected["shard_rotation"],
        )
    values = {s.name: data[f"table/{s.name}"] for s in specs}
    stacked = stack_and_shard(stack, values)
    np.testing.assert_array_equal(stacked, data["stacked_shards"])
    np.testing.assert_array_equal(stacked.reshape(-1, stack.embedding_dim), data["stacked_global"])
    for s in specs:
        np.testing.assert_array_equal(
            physical_row_ids(stack, s.name), data[f"physical_row_ids/{s.name}"]
        )
    back = unshard_and_unstack(stack, data["stacked_global"])
    for s in specs:
        np.testing.assert_array_equal(back[s.name], values[s.name])
