"""The radix sort and the key layout of host preprocessing."""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.preprocess.keys import KeyLayout, stable_argsort


@pytest.mark.parametrize("bound", [1, 2, 200, 256, 257, 2**16, 2**16 + 1, 2**24, 2**31, 2**40])
def test_stable_argsort_matches_numpy_stable_sort(bound):
    rng = np.random.default_rng(bound)
    for dtype in (np.int32, np.int64):
        if bound > 2**31 and dtype == np.int32:
            continue
        # Few distinct values, so stability matters.
        keys = rng.integers(0, bound, 5000, dtype=np.int64)[rng.integers(0, 300, 5000)]
        keys = keys.astype(dtype)
        np.testing.assert_array_equal(stable_argsort(keys, bound), np.argsort(keys, kind="stable"))


@pytest.mark.parametrize("sparsecore_major", [False, True])
def test_key_fields_round_trip_and_sort_in_the_documented_order(sparsecore_major):
    layout = KeyLayout(
        sparsecores=8,
        num_sparsecores=16,
        rows_per_shard=1000,
        sparsecores_per_device=4,
        sparsecore_major=sparsecore_major,
    )
    rng = np.random.default_rng(0)
    local_sc = rng.integers(0, 8, 1000)
    partition = rng.integers(0, 16, 1000)
    row = rng.integers(0, 1000, 1000)
    keys = layout.sample_part(local_sc) | layout.id_part(partition, row)
    assert keys.max() < layout.bound and layout.dtype == np.int32
    np.testing.assert_array_equal(layout.bucket(keys), local_sc * 16 + partition)
    np.testing.assert_array_equal(layout.row(keys), row)
    device, sparsecore = np.divmod(local_sc, 4)
    if sparsecore_major:
        expected = np.lexsort((row, partition, local_sc))
    else:
        expected = np.lexsort((sparsecore, row, partition, device))
        row_keys = layout.row_key(keys)
        np.testing.assert_array_equal(layout.device_partition(row_keys), device * 16 + partition)
        np.testing.assert_array_equal(layout.row_of_row_key(row_keys), row)
    np.testing.assert_array_equal(np.argsort(keys, kind="stable"), expected)
    chunk = layout.chunk(4, 8)
    inside = local_sc >= 4
    relative = keys[inside] - layout.base(4)
    assert relative.min() >= 0 and relative.max() < chunk.bound
    np.testing.assert_array_equal(
        chunk.bucket(relative), (local_sc[inside] - 4) * 16 + partition[inside]
    )


def test_device_major_chunks_must_be_whole_devices():
    layout = KeyLayout(8, 16, 1000, 4, sparsecore_major=False)
    with pytest.raises(ValueError, match=r"whole devices, got \[2, 8\)"):
        layout.chunk(2, 8)
