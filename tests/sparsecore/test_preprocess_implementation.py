"""Choosing the host-preprocessing implementation: compiled where it builds, NumPy otherwise,
never silently. (Both implementations' results are tested in test_preprocess, test_golden and
test_roundtrip, each run once per implementation.)"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import RaggedIds, native, pipeline, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

TOPOLOGY = Topology.cpu(1, 2)
STACKS = stack_tables([FeatureSpec("f", TableSpec("t", 64, 8), 4)], TOPOLOGY)
INPUTS = {"f": RaggedIds(np.array([3, 5, 3, 9]), lengths=np.array([2, 1, 0, 1]))}


def test_unknown_implementation_is_an_error():
    with pytest.raises(ValueError, match="implementation must be 'auto', 'native' or 'numpy', got 'c'"):
        preprocess(STACKS, INPUTS, TOPOLOGY, implementation="c")


def test_native_without_a_compiler_raises_and_auto_warns_then_uses_numpy(monkeypatch):
    monkeypatch.setattr(native, "build_error", lambda: "no C++ compiler (c++ or g++ on PATH, or $CXX)")
    with pytest.raises(RuntimeError, match="compiled preprocessing is unavailable: no C\\+\\+ compiler"):
        preprocess(STACKS, INPUTS, TOPOLOGY, implementation="native")
    with pytest.warns(UserWarning, match="compiled host preprocessing is unavailable .*preprocessing with NumPy"):
        assert pipeline._auto_native.__wrapped__() is False


def test_auto_is_the_compiled_path_here_and_both_agree():
    assert native.build_error() is None
    assert pipeline._native_selected("auto")
    auto = preprocess(STACKS, INPUTS, TOPOLOGY)["t"]
    numpy = preprocess(STACKS, INPUTS, TOPOLOGY, implementation="numpy")["t"]
    for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
        np.testing.assert_array_equal(getattr(auto, field), getattr(numpy, field))
    for field in ("unique_ids", "unique_counts", "entry_unique_index"):
        np.testing.assert_array_equal(getattr(auto.unique, field), getattr(numpy.unique, field))


def assert_same_batches(a, b):
    for name in a:
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            np.testing.assert_array_equal(getattr(a[name], field), getattr(b[name], field), err_msg=field)
        if a[name].unique is not None:
            for field in ("unique_ids", "unique_counts", "entry_unique_index"):
                np.testing.assert_array_equal(getattr(a[name].unique, field), getattr(b[name].unique, field))
        sa, sb = a[name].stats, b[name].stats
        for field in ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sparsecore"):
            np.testing.assert_array_equal(getattr(sa, field), getattr(sb, field), err_msg=field)
        assert (sa.id_drop_count, sa.table_max_ids_per_partition, sa.table_max_unique_ids_per_partition) == (
            sb.id_drop_count, sb.table_max_ids_per_partition, sb.table_max_unique_ids_per_partition
        )


# Row bits of the shard: 6 (the first sort digit covers the row), 12 (one later radix pass),
# 23 (two later passes); each with partitions of more and fewer than 24 ids (the radix and the
# insertion sort), weights (mean combiner) and dropping.
@pytest.mark.parametrize("vocabulary", [2**7, 2**13, 2**24])
@pytest.mark.parametrize("dropping", [False, True])
def test_compiled_and_numpy_agree_on_wide_rows(vocabulary, dropping):
    rng = np.random.default_rng(vocabulary)
    topology = Topology.cpu(2, 2)
    limit = 40 if dropping else 4096
    tables = [
        TableSpec(f"t{i}", vocabulary, 8, combiner="mean", max_ids_per_partition=limit, max_unique_ids_per_partition=limit)
        for i in range(2)
    ]
    features = [FeatureSpec("dense", tables[0], 64), FeatureSpec("sparse", tables[1], 64)]
    stacks = stack_tables(features, topology, [StackGroup(("t0", "t1"))])
    dense = rng.integers(0, 60, 64)
    dense[48:] = 0  # the last SparseCore sees only "sparse": partitions of a few ids
    lengths = {"dense": dense, "sparse": rng.integers(0, 3, 64)}
    inputs = {}
    for name, feature_lengths in lengths.items():
        count = int(feature_lengths.sum())
        # "sparse" draws from 20 ids spread over the vocabulary: duplicates, rows of all sizes.
        ids = rng.integers(0, vocabulary, count) if name == "dense" else rng.choice(rng.integers(0, vocabulary, 20), count)
        inputs[name] = RaggedIds(ids, lengths=feature_lengths, weights=rng.uniform(0.5, 2.0, count))
    native = preprocess(stacks, inputs, topology, allow_id_dropping=dropping, implementation="native", num_threads=2)
    numpy = preprocess(stacks, inputs, topology, allow_id_dropping=dropping, implementation="numpy")
    assert_same_batches(native, numpy)
    assert (native[stacks[0].name].stats.id_drop_count > 0) == dropping
