"""Group one stack's ids by (SparseCore, partition), merge duplicates, count, and apply limits.

Every id arrives in input order with its sort key (`KeyLayout`), its SparseCore-local sample id
and its gain. A stable sort by key leaves ids of one SparseCore and column in input order, which
is ascending sample order, so duplicate (sample, column) pairs are adjacent runs; their gains are
summed in input order in float32, as the reference does. Key order is the buffers' order, so the
pairs of each bucket (local SparseCore * N + partition) are one contiguous range, found by a
binary search for the bucket's first key; counts per bucket and per table of the stack are
differences of such positions, with no pass over the pairs.

Stats follow; the stack's limits then raise `PartitionLimitError` or, with dropping allowed,
drop the pairs past them, counting every raw id dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sparsecore.layout import StackedTable
from sparsecore.preprocess.keys import KeyLayout, sorted_order

__all__ = [
    "MergedPairs",
    "PartitionLimitError",
    "check_limits",
    "exceeds_limits",
    "merge_pairs",
    "select_pairs",
]


def first_of_runs(values: np.ndarray) -> np.ndarray:
    """Boolean mask of elements that differ from their predecessor (the first is always True)."""
    first = np.ones(len(values), dtype=bool)
    np.not_equal(values[1:], values[:-1], out=first[1:])
    return first


def exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    return np.cumsum(counts) - counts


class PartitionLimitError(ValueError):
    """More ids (or unique ids) for one partition than the stack allows, with dropping off."""

    def __init__(
        self,
        stack: StackedTable,
        limit: str,
        observed: int,
        configured: int,
        device: int,
        sparsecore: int,
        partition: int,
        features: tuple[str, ...],
    ) -> None:
        self.stack, self.limit = stack.name, limit
        self.observed, self.configured = observed, configured
        self.device, self.sparsecore, self.partition = device, sparsecore, partition
        self.features = features
        super().__init__(
            f"Observed {limit} {observed} for stacked table {stack.name!r} (tables "
            f"{', '.join(stack.table_names)}; features {', '.join(features)}) on local device "
            f"{device}, SparseCore {sparsecore}, partition {partition} is greater than the "
            f"configured {limit} {configured}. Enable allow_id_dropping, or raise the limit "
            "(update_limits gives limits from observed stats)."
        )


@dataclass(frozen=True)
class MergedPairs:
    """Distinct (sample, column) pairs of a chunk of one stack after the limits, in buffer order
    (bucket = SparseCore * N + partition, embedding id, sample), keys relative to the chunk's
    first SparseCore.

    Per pair: `keys`, `samples`, float32 `gains`, and `counts` (raw ids merged into it). The
    pairs of bucket b are [bucket_starts[b], bucket_starts[b + 1]). `ids_per_bucket` /
    `unique_per_bucket` count pairs / distinct columns per bucket BEFORE dropping
    ([SparseCores, N]); `dropped_ids` counts raw ids dropped.
    """

    keys: np.ndarray
    samples: np.ndarray
    gains: np.ndarray
    counts: np.ndarray
    bucket_starts: np.ndarray
    ids_per_bucket: np.ndarray
    unique_per_bucket: np.ndarray
    table_ids_max: tuple[int, ...]
    table_unique_max: tuple[int, ...]
    dropped_ids: int

    @property
    def kept_per_bucket(self) -> np.ndarray:
        """Pairs per bucket after dropping, `[SparseCores, N]`."""
        return np.diff(self.bucket_starts).reshape(self.ids_per_bucket.shape)

    def bucket_of_pairs(self) -> np.ndarray:
        """The bucket of every pair."""
        return np.repeat(np.arange(len(self.bucket_starts) - 1), np.diff(self.bucket_starts))


def _table_maxima(
    stack: StackedTable,
    layout: KeyLayout,
    keys: np.ndarray,
    columns_before: np.ndarray,
    ids_per_bucket: np.ndarray,
    unique_per_bucket: np.ndarray,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Largest per-(SparseCore, partition) pair and column counts of each table of the stack.
    A table's rows are one range of every shard, so its pairs in a bucket are one range of the
    sorted keys too. `columns_before[i]`: distinct columns among the first i pairs."""
    if len(stack.tables) == 1:
        return (int(ids_per_bucket.max(initial=0)),), (int(unique_per_bucket.max(initial=0)),)
    starts = np.array([t.row_offset_in_shard for t in stack.tables] + [1 << layout.row_bits])
    first_keys = layout.bucket_key(np.arange(layout.buckets)[:, None]) + starts
    positions = np.searchsorted(keys, first_keys)
    ids = np.diff(positions, axis=1)
    unique = np.diff(columns_before[positions], axis=1)
    return tuple(ids.max(axis=0).tolist()), tuple(unique.max(axis=0).tolist())


def check_limits(
    stack: StackedTable,
    ids_per_bucket: np.ndarray,
    unique_per_bucket: np.ndarray,
    first_sparsecore: int,
    sparsecores_per_device: int,
    features_in_bucket: Callable[[int], np.ndarray],
) -> None:
    """Raise `PartitionLimitError` if a (SparseCore, partition) of local SparseCores
    `first_sparsecore`, ... (counts `[SparseCores, N]`) exceeds a limit of the stack: the one with
    the largest count, max_ids_per_partition checked first. `features_in_bucket(b)` gives the
    indices (into `stack.features`) of the features with ids in bucket b of the counts."""
    limits = (
        ("max_ids_per_partition", ids_per_bucket, stack.max_ids_per_partition),
        ("max_unique_ids_per_partition", unique_per_bucket, stack.max_unique_ids_per_partition),
    )
    for limit, counts, configured in limits:
        if counts.max(initial=0) > configured:
            worst = int(np.argmax(counts))
            local_sc, partition = divmod(worst, counts.shape[1])
            device, sparsecore = divmod(first_sparsecore + local_sc, sparsecores_per_device)
            names = tuple(stack.features[f].feature.name for f in features_in_bucket(worst))
            raise PartitionLimitError(
                stack, limit, int(counts.flat[worst]), configured, device, sparsecore, partition, names
            )


def exceeds_limits(stack: StackedTable, ids_per_bucket: np.ndarray, unique_per_bucket: np.ndarray) -> bool:
    """Whether any (SparseCore, partition) exceeds a limit of the stack."""
    return bool(
        ids_per_bucket.max(initial=0) > stack.max_ids_per_partition
        or unique_per_bucket.max(initial=0) > stack.max_unique_ids_per_partition
    )


def merge_pairs(
    stack: StackedTable,
    layout: KeyLayout,
    keys: np.ndarray,
    samples: np.ndarray,
    gains: np.ndarray | None,
    feature_starts: np.ndarray,
    allow_id_dropping: bool,
    first_sparsecore: int,
    sparsecores_per_device: int,
) -> MergedPairs:
    """Sort, merge and count the ids of a chunk of one stack's local SparseCores (from
    `first_sparsecore` on, keys relative to it), then enforce the stack's limits.

    `feature_starts[f]` is where feature f's ids start in the inputs (to name it in errors).
    """
    order, sorted_keys = sorted_order(keys, layout.bound)
    sorted_samples = samples[order]
    new_column = first_of_runs(sorted_keys)
    new_pair = new_column | first_of_runs(sorted_samples)
    starts = np.flatnonzero(new_pair)
    count = np.empty(len(starts), dtype=np.int64)
    np.subtract(starts[1:], starts[:-1], out=count[:-1])
    count[-1:] = len(keys) - starts[-1:]
    if gains is None:
        gain = count.astype(np.float32)
    elif len(starts) == len(keys):
        gain = gains[order]
    else:
        gain = np.zeros(len(starts), dtype=np.float32)
        np.add.at(gain, np.cumsum(new_pair, dtype=np.int32) - 1, gains[order])
    pair_keys = sorted_keys[starts]
    columns_before = np.zeros(len(starts) + 1, dtype=np.int32)
    np.cumsum(new_column[starts], dtype=np.int32, out=columns_before[1:])
    bucket_starts = np.searchsorted(pair_keys, layout.bucket_key(np.arange(layout.buckets + 1)))
    shape = (layout.sparsecores, layout.num_sparsecores)
    ids_per_bucket = np.diff(bucket_starts).reshape(shape)
    unique_per_bucket = np.diff(columns_before[bucket_starts]).reshape(shape)
    table_ids_max, table_unique_max = _table_maxima(
        stack, layout, pair_keys, columns_before, ids_per_bucket, unique_per_bucket
    )
    pairs = MergedPairs(
        keys=pair_keys,
        samples=sorted_samples[starts],
        gains=gain,
        counts=count,
        bucket_starts=bucket_starts,
        ids_per_bucket=ids_per_bucket,
        unique_per_bucket=unique_per_bucket,
        table_ids_max=table_ids_max,
        table_unique_max=table_unique_max,
        dropped_ids=0,
    )
    if not exceeds_limits(stack, ids_per_bucket, unique_per_bucket):
        return pairs
    if not allow_id_dropping:
        pair_feature = np.searchsorted(feature_starts, order[starts], side="right") - 1
        check_limits(
            stack, ids_per_bucket, unique_per_bucket, first_sparsecore, sparsecores_per_device,
            lambda b: np.unique(pair_feature[bucket_starts[b] : bucket_starts[b + 1]]),
        )
    bucket = pairs.bucket_of_pairs()
    rank = np.arange(len(starts)) - bucket_starts[bucket]
    column_rank = columns_before[1:] - 1 - columns_before[bucket_starts[bucket]]
    keep = (rank < stack.max_ids_per_partition) & (column_rank < stack.max_unique_ids_per_partition)
    return select_pairs(pairs, keep, layout)


def select_pairs(pairs: MergedPairs, keep: np.ndarray, layout: KeyLayout) -> MergedPairs:
    """Only the pairs where `keep` holds; the rest are counted as dropped ids."""
    keys = pairs.keys[keep]
    return MergedPairs(
        keys=keys,
        samples=pairs.samples[keep],
        gains=pairs.gains[keep],
        counts=pairs.counts[keep],
        bucket_starts=np.searchsorted(keys, layout.bucket_key(np.arange(layout.buckets + 1))),
        ids_per_bucket=pairs.ids_per_bucket,
        unique_per_bucket=pairs.unique_per_bucket,
        table_ids_max=pairs.table_ids_max,
        table_unique_max=pairs.table_unique_max,
        dropped_ids=pairs.dropped_ids + int(pairs.counts[~keep].sum()),
    )
