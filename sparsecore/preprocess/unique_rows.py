"""The stand-in's unique-row side-car: the distinct rows each local device looks up in each
partition, and for every entry of the buffers the index of its row among them.

It is derived from the pairs just written into the buffers. Pairs are in buffer order, so each
SparseCore's distinct columns (partition, row) come out ascending; a device's lists are the merge
of its SparseCores' -- a stable sort of S sorted runs, which NumPy's merge sort does in near
linear time -- and every pair takes the index of its column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sparsecore.preprocess.keys import KeyLayout
from sparsecore.preprocess.partition import MergedPairs, exclusive_cumsum, first_of_runs

__all__ = ["SparseCoreColumns", "UniqueRows", "sparsecore_columns", "write_unique_rows"]


@dataclass(frozen=True)
class UniqueRows:
    """Stand-in aid, derived from (never replacing) the hardware buffers: the distinct rows each
    local device looks up in each partition, so a CPU kernel gathers every row once.

    `unique_ids [L, N, U] int32`: ascending local rows (the buffers' embedding ids) of partition
    p looked up by any SparseCore of device d, then pads (`PAD_ID`); `unique_counts [L, N] int32`:
    how many are real. `entry_unique_index [L, C] int32`: for each real entry of
    `embedding_ids[d]`, the flat index p * U + k into `unique_ids[d].reshape(N * U)` of its row
    (so `embedding_ids[d, c] == unique_ids[d].reshape(-1)[entry_unique_index[d, c]]`); `PAD_ID`
    on pad slots. U is `BufferSizes.unique_rows_per_partition`.
    """

    unique_ids: np.ndarray
    unique_counts: np.ndarray
    entry_unique_index: np.ndarray


@dataclass(frozen=True)
class SparseCoreColumns:
    """The distinct columns one local SparseCore's written entries look up: ascending `keys`
    (`KeyLayout.column`: partition and row), the number of `pairs` of each, and the buffer
    `slots` of those pairs, column by column (flat over the host's devices)."""

    keys: np.ndarray
    pairs: np.ndarray
    slots: np.ndarray


def sparsecore_columns(layout: KeyLayout, pairs: MergedPairs, slots: np.ndarray) -> list[SparseCoreColumns]:
    """Per SparseCore of a chunk (in order), its columns, from the pairs `pack_chunk` wrote at
    `slots`."""
    starts = np.flatnonzero(first_of_runs(pairs.keys))
    keys = pairs.keys[starts]
    per_column = np.diff(np.append(starts, len(pairs.keys)))
    bounds = np.searchsorted(keys, layout.base(np.arange(layout.sparsecores + 1)))
    columns = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        first_pair = starts[lo] if lo < len(starts) else len(pairs.keys)
        last_pair = starts[hi] if hi < len(starts) else len(pairs.keys)
        columns.append(
            SparseCoreColumns(layout.column(keys[lo:hi]), per_column[lo:hi], slots[first_pair:last_pair])
        )
    return columns


def write_unique_rows(
    unique: UniqueRows, device: int, columns: Sequence[SparseCoreColumns], layout: KeyLayout
) -> None:
    """Fill local device `device`'s side-car from the columns of its SparseCores."""
    width = unique.unique_ids.shape[-1]
    keys = np.concatenate([c.keys for c in columns])
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    new_row = first_of_runs(sorted_keys)
    row_keys = sorted_keys[new_row]
    partition = row_keys >> layout.row_bits
    counts = np.bincount(partition, minlength=layout.num_sparsecores)
    rank = np.arange(len(row_keys)) - exclusive_cumsum(counts)[partition]
    flat_index = (partition * width + rank).astype(np.int32)
    unique.unique_counts[device] = counts
    unique.unique_ids[device].reshape(-1)[flat_index] = layout.row(row_keys)
    index = np.empty(len(keys), dtype=np.int32)
    index[order] = flat_index[np.cumsum(new_row, dtype=np.int32) - 1]
    pairs = np.concatenate([c.pairs for c in columns])
    slots = np.concatenate([c.slots for c in columns])
    unique.entry_unique_index.reshape(-1)[slots] = np.repeat(index, pairs)
