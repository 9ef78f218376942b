"""Randomised round trips over 1, 2 and 8 stand-in devices (and 1-4 SparseCores per device).

For random stacks, features and ragged inputs (int32/int64 ids, float32/float64 weights,
sequence features, several hosts, dropping on or off) the packed buffers must
1. equal the loop-per-id reference model exactly (buffers, stats, drop counts), and
2. decode back to exactly the input's (feature, row, id, gain) multiset after merging
   duplicates, when nothing was dropped;
and the unique-row side-car must index the same rows as the buffers.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _reference_model import ids_with_gains, preprocess_model
from sparsecore.layout import StackGroup, shard_and_local_row, stack_tables
from sparsecore.preprocess import PAD_ID, PartitionLimitError, RaggedIds, pipeline, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

# Every test here runs with each host-preprocessing implementation (tests/sparsecore/conftest.py).
pytestmark = pytest.mark.usefixtures("each_preprocess_implementation")


@st.composite
def scenarios(draw):
    devices = draw(st.sampled_from([1, 2, 8]))
    per_device = draw(st.sampled_from([1, 2, 4]))
    hosts = draw(st.sampled_from([1, 2] if devices > 1 else [1]))
    topology = Topology.cpu(devices, per_device, local_device_count=devices // hosts)
    combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    dropping = draw(st.booleans())
    limit = draw(st.integers(1, 6)) if dropping else 10_000
    tables = [
        TableSpec(
            f"t{i}",
            draw(st.integers(1, 300)),
            8,
            combiner=combiner,
            max_ids_per_partition=limit,
            max_unique_ids_per_partition=limit,
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    features = []
    for i in range(draw(st.integers(1, 3))):
        sequence = draw(st.sampled_from([None, None, 1, 3]))
        batch = topology.num_sparsecores * draw(st.integers(1, 3))
        features.append(
            FeatureSpec(f"f{i}", draw(st.sampled_from(tables)), batch, max_sequence_length=sequence)
        )
    used = sorted({f.table.name for f in features})
    stacked = draw(st.booleans())
    groups = (
        [StackGroup(tuple(used), rotation=draw(st.sampled_from([None, 0, 1, 3])))]
        if stacked
        else []
    )
    stacks = stack_tables(features, topology, groups)
    unique_rows = draw(st.booleans())
    chunk_ids = draw(st.sampled_from([1, 7, pipeline.CHUNK_IDS]))
    return topology, stacks, dropping, unique_rows, chunk_ids, draw(st.integers(0, 2**32 - 1))


def make_inputs(stacks, topology, seed):
    rng = np.random.default_rng(seed)
    inputs, model_inputs = {}, {}
    for stack in stacks:
        for placement in stack.features:
            feature = placement.feature
            vocab = feature.table.vocabulary_size
            samples = (
                feature.batch_size * topology.local_device_count // topology.global_device_count
            )
            lengths = rng.integers(0, (feature.max_sequence_length or 5) + 1, samples)
            high = vocab if rng.random() < 0.5 else min(vocab, 6)  # few distinct ids: duplicates
            values = rng.integers(0, high, lengths.sum()).astype(rng.choice([np.int32, np.int64]))
            weights = None
            if rng.random() < 0.5:
                weights = (rng.random(lengths.sum()) * 2 + 0.05).astype(
                    rng.choice([np.float32, np.float64])
                )
            inputs[feature.name] = RaggedIds(values, lengths=lengths, weights=weights)
            split = np.cumsum(lengths)[:-1]
            model_inputs[feature.name] = (
                np.split(values, split),
                None if weights is None else np.split(weights, split),
            )
    return inputs, model_inputs


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    if expected.dtype == np.float32:
        np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
        actual, expected = np.nan_to_num(actual).view(np.uint32), np.nan_to_num(expected).view(
            np.uint32
        )
    np.testing.assert_array_equal(actual, expected)


def decode(stack, batch, topology) -> dict:
    """(feature, host-local row, id) -> gain of every real entry of the buffers."""
    n, per_device = topology.num_sparsecores, topology.sparsecores_per_device
    r, segment = batch.sizes.row_pointers_per_sparsecore, batch.sizes.coo_buffer_size_per_sparsecore
    decoded = {}
    for d in range(topology.local_device_count):
        for s in range(per_device):
            start = 0
            for p in range(n):
                end = batch.row_pointers[d, s * r + p]
                for slot in range(s * segment + start, s * segment + end):
                    sample, row = batch.sample_ids[d, slot], batch.embedding_ids[d, slot]
                    fp = next(
                        f
                        for f in stack.features
                        if f.sample_offset_in_sparsecore
                        <= sample
                        < f.sample_offset_in_sparsecore + f.samples_per_sparsecore
                    )
                    table = stack.tables[fp.table_index]
                    local = row - table.row_offset_in_shard
                    assert 0 <= local < table.rows_in_shard
                    ident = int(local * n + (p - table.shard_rotation) % n)
                    assert ident < table.table.vocabulary_size
                    assert shard_and_local_row(stack, table.table.name, np.array([ident])) == (
                        p,
                        row,
                    )
                    host_row = (
                        (d * per_device + s) * fp.samples_per_sparsecore
                        + sample
                        - fp.sample_offset_in_sparsecore
                    )
                    key = (fp.feature.name, int(host_row), ident)
                    assert key not in decoded
                    decoded[key] = batch.gains[d, slot]
                start = (end + 7) // 8 * 8
    return decoded


def merged_input(stack, model_inputs) -> dict:
    """(feature, host-local row, id) -> float32 gain summed in input order, from the raw input."""
    expected = {}
    for fp, row, ident, gain in ids_with_gains(stack, model_inputs):
        key = (fp.feature.name, row, ident)
        expected[key] = np.float32(expected.get(key, np.float32(0)) + gain)
    return expected


def assert_unique_rows_consistent(batch, n) -> None:
    unique, width = batch.unique, batch.sizes.unique_rows_per_partition
    for d in range(batch.embedding_ids.shape[0]):
        real = batch.embedding_ids[d] != PAD_ID
        flat = unique.unique_ids[d].reshape(-1)
        np.testing.assert_array_equal(
            flat[unique.entry_unique_index[d, real]], batch.embedding_ids[d, real]
        )
        for p in range(n):
            count = unique.unique_counts[d, p]
            in_partition = real & (unique.entry_unique_index[d] // width == p)
            assert np.array_equal(
                np.unique(batch.embedding_ids[d, in_partition]), unique.unique_ids[d, p, :count]
            )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_buffers_match_model_and_decode_to_the_input(scenario):
    topology, stacks, dropping, unique_rows, chunk_ids, seed = scenario
    inputs, model_inputs = make_inputs(stacks, topology, seed)
    with mock.patch.object(pipeline, "CHUNK_IDS", chunk_ids):  # 1: a chunk per device or SC
        batches = preprocess(
            stacks,
            inputs,
            topology,
            allow_id_dropping=dropping,
            with_unique_rows=unique_rows,
            num_threads=2,
        )
    for stack in stacks:
        batch = batches[stack.name]
        model = preprocess_model(
            stack, model_inputs, topology, dropping, batch.sizes.coo_buffer_size_per_device
        )
        for field, expected in (
            ("row_pointers", model.row_pointers),
            ("embedding_ids", model.embedding_ids),
            ("sample_ids", model.sample_ids),
            ("gains", model.gains),
        ):
            assert_same(getattr(batch, field), expected)
        assert_same(batch.stats.max_ids_per_partition, model.max_ids)
        assert_same(batch.stats.max_unique_ids_per_partition, model.max_unique)
        assert_same(batch.stats.required_buffer_size_per_sparsecore, model.required)
        assert batch.stats.id_drop_count == model.dropped
        if unique_rows:
            assert_unique_rows_consistent(batch, topology.num_sparsecores)
        else:
            assert batch.unique is None
        if model.dropped == 0:
            decoded = decode(stack, batch, topology)
            expected = merged_input(stack, model_inputs)
            assert decoded.keys() == expected.keys()
            for key, gain in expected.items():
                assert_same(np.array([decoded[key]]), np.array([gain]))


@settings(max_examples=15, deadline=None)
@given(scenarios())
def test_limits_without_dropping_raise_exactly_when_the_model_overflows(scenario):
    topology, stacks, _, _, chunk_ids, seed = scenario
    stacks = tuple(s.with_limits(3, 2, None) for s in stacks)
    inputs, model_inputs = make_inputs(stacks, topology, seed)
    over = False
    for stack in stacks:
        model = preprocess_model(stack, model_inputs, topology, False, 10**6)
        over |= bool(model.max_ids.max(initial=0) > 3 or model.max_unique.max(initial=0) > 2)
    with mock.patch.object(pipeline, "CHUNK_IDS", chunk_ids):
        if over:
            with pytest.raises(PartitionLimitError):
                preprocess(stacks, inputs, topology)
        else:
            preprocess(stacks, inputs, topology)
