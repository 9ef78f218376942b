"""The sort and the key layout of host preprocessing."""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.preprocess.keys import KeyLayout, sorted_order


@pytest.mark.parametrize("bound", [1, 2, 200, 256, 257, 2**16, 2**16 + 1, 2**24, 2**31, 2**40, 2**62])
def test_sorted_order_matches_numpy_stable_sort(bound):
    rng = np.random.default_rng(bound % 2**32)
    for dtype in (np.int32, np.int64):
        if bound > 2**31 and dtype == np.int32:
            continue
        # Few distinct values, so stability matters; 2**62 needs two passes next to 13 position bits.
        keys = rng.integers(0, bound, 5000, dtype=np.int64)[rng.integers(0, 300, 5000)]
        keys = keys.astype(dtype)
        order, sorted_keys = sorted_order(keys, bound)
        np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
        np.testing.assert_array_equal(sorted_keys, keys[order])
        assert sorted_keys.dtype == dtype


def test_sorted_order_of_nothing():
    order, sorted_keys = sorted_order(np.zeros(0, np.int32), 10)
    assert len(order) == 0 and len(sorted_keys) == 0


def test_key_fields_round_trip_and_sort_in_buffer_order():
    layout = KeyLayout(sparsecores=8, num_sparsecores=16, rows_per_shard=1000)
    rng = np.random.default_rng(0)
    local_sc = rng.integers(0, 8, 1000)
    partition = rng.integers(0, 16, 1000)
    row = rng.integers(0, 1000, 1000)
    keys = layout.sparsecore_part(local_sc) | layout.id_part(partition, row)
    assert keys.max() < layout.bound and layout.dtype == np.int32
    np.testing.assert_array_equal(layout.bucket(keys), local_sc * 16 + partition)
    np.testing.assert_array_equal(layout.row(keys), row)
    np.testing.assert_array_equal(layout.column(keys), layout.id_part(partition, row))
    np.testing.assert_array_equal(np.argsort(keys, kind="stable"), np.lexsort((row, partition, local_sc)))
    assert np.all(keys >= layout.bucket_key(layout.bucket(keys)))
    chunk = layout.chunk(4, 8)
    inside = local_sc >= 4
    relative = keys[inside] - layout.base(4)
    assert relative.min() >= 0 and relative.max() < chunk.bound
    np.testing.assert_array_equal(
        chunk.bucket(relative), (local_sc[inside] - 4) * 16 + partition[inside]
    )
