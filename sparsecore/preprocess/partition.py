"""Group one stack's ids by (SparseCore, partition), merge duplicates, count, and apply limits.

Every id arrives in input order with its sort key (`KeyLayout`), its SparseCore-local sample id
and its gain. A stable sort by key leaves ids of one SparseCore and column in input order, which
is ascending sample order, so duplicate (sample, column) pairs are adjacent runs; their gains are
summed in input order in float32, as the reference does. With device-major keys the pairs of one
(device, partition, row) are adjacent too -- the unique-row side-car's groups -- and a second
16-bit pass by bucket (local SparseCore * N + partition) gives each pair's rank in the buffer
order (SparseCore, partition, embedding id, sample); SparseCore-major keys are in that order
already. Pairs stay in key order and carry their rank, which with the bucket fixes their slot.

Stats follow; the stack's limits then raise `PartitionLimitError` or, with dropping allowed,
drop the pairs past them, counting every raw id dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sparsecore.layout import StackedTable
from sparsecore.preprocess.keys import KeyLayout, stable_argsort

__all__ = ["MergedPairs", "PartitionLimitError", "merge_pairs", "select_pairs"]


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
    """Distinct (sample, column) pairs of a chunk of one stack after the limits, in key order
    (then sample), with buckets relative to the chunk's first SparseCore.

    `bucket` = SparseCore * N + partition; `rank` is the pair's position among its bucket's
    pairs in buffer order (embedding id, sample), so its slot is the bucket's start plus `rank`.
    Dropping only ever removes a tail of a bucket, so ranks stay valid. `row_group` numbers the
    distinct (device, partition, embedding id) of each pair in ascending order;
    `row_group_key[g]` is group g's `KeyLayout.row_key`. `ids_per_bucket` / `unique_per_bucket`
    count pairs / distinct columns per bucket BEFORE dropping ([SparseCores, N]);
    `kept_per_bucket` counts the pairs that remain; `dropped_ids` counts raw ids dropped.
    """

    bucket: np.ndarray
    rank: np.ndarray
    embedding_id: np.ndarray
    sample: np.ndarray
    gain: np.ndarray
    count: np.ndarray
    row_group: np.ndarray
    row_group_key: np.ndarray
    ids_per_bucket: np.ndarray
    unique_per_bucket: np.ndarray
    kept_per_bucket: np.ndarray
    table_ids_max: tuple[int, ...]
    table_unique_max: tuple[int, ...]
    dropped_ids: int


def _table_maxima(
    stack: StackedTable,
    bucket: np.ndarray,
    embedding_id: np.ndarray,
    new_column: np.ndarray,
    ids_per_bucket: np.ndarray,
    unique_per_bucket: np.ndarray,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Largest per-(SparseCore, partition) pair and column counts of each table of the stack."""
    num_tables = len(stack.tables)
    if num_tables == 1:
        return (int(ids_per_bucket.max(initial=0)),), (int(unique_per_bucket.max(initial=0)),)
    starts = np.array([t.row_offset_in_shard for t in stack.tables])
    key = bucket * num_tables + np.searchsorted(starts, embedding_id, side="right") - 1
    size = ids_per_bucket.size * num_tables
    ids = np.bincount(key, minlength=size).reshape(-1, num_tables)
    unique = np.bincount(key[new_column], minlength=size).reshape(-1, num_tables)
    return tuple(ids.max(axis=0).tolist()), tuple(unique.max(axis=0).tolist())


def _raise_limit_error(
    stack: StackedTable,
    limit: str,
    counts: np.ndarray,
    configured: int,
    layout: KeyLayout,
    first_sparsecore: int,
    pair_bucket: np.ndarray,
    pair_feature: np.ndarray,
) -> None:
    """Raise `PartitionLimitError` for the (SparseCore, partition) with the largest count."""
    worst = int(np.argmax(counts))
    local_sc, partition = divmod(worst, counts.shape[1])
    device, sparsecore = divmod(first_sparsecore + local_sc, layout.sparsecores_per_device)
    features = np.unique(pair_feature[pair_bucket == worst])
    names = tuple(stack.features[f].feature.name for f in features)
    raise PartitionLimitError(
        stack, limit, int(counts.flat[worst]), configured, device, sparsecore, partition, names
    )


class _Runs(NamedTuple):
    """Ids sorted by key, and the runs of equal (key, sample) in that order: one per pair."""

    order: np.ndarray
    keys: np.ndarray
    samples: np.ndarray
    starts: np.ndarray
    count: np.ndarray
    gain: np.ndarray
    new_column: np.ndarray


def _merge_runs(
    keys: np.ndarray, samples: np.ndarray, gains: np.ndarray | None, bound: int
) -> _Runs:
    """Sort by key; find each (key, sample) run's first id, its length, its float32 gain sum in
    input order, and whether it starts a new column (key)."""
    order = stable_argsort(keys, bound)
    sorted_keys = keys[order]
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
        np.add.at(gain, np.cumsum(new_pair) - 1, gains[order])
    return _Runs(order, sorted_keys, sorted_samples, starts, count, gain, new_column[starts])


def merge_pairs(
    stack: StackedTable,
    layout: KeyLayout,
    keys: np.ndarray,
    samples: np.ndarray,
    gains: np.ndarray | None,
    feature_starts: np.ndarray,
    allow_id_dropping: bool,
    with_row_groups: bool,
    first_sparsecore: int,
) -> MergedPairs:
    """Sort, merge and count the ids of a chunk of one stack's local SparseCores (from
    `first_sparsecore` on, keys relative to it), then enforce the stack's limits.

    `feature_starts[f]` is where feature f's ids start in the inputs (to name it in errors).
    `with_row_groups` computes the (device, partition, row) groups the unique-row side-car
    needs (device-major keys only); otherwise `row_group` is empty.
    """
    runs = _merge_runs(keys, samples, gains, layout.bound)
    new_column = runs.new_column
    pair_keys = runs.keys[runs.starts]
    bucket = layout.bucket(pair_keys)
    embedding_id = layout.row(pair_keys)
    buckets = layout.buckets
    ids_per_bucket = np.bincount(bucket, minlength=buckets)
    unique_per_bucket = np.bincount(bucket, new_column, minlength=buckets).astype(np.int64)
    row_group = row_group_key = np.zeros(0, dtype=np.int64)
    if with_row_groups:
        row_keys = layout.row_key(pair_keys)
        new_group = first_of_runs(row_keys)
        row_group = np.cumsum(new_group) - 1
        row_group_key = row_keys[new_group]
    if layout.in_buffer_order:
        by_bucket, sorted_bucket = None, bucket
    else:
        by_bucket = stable_argsort(bucket, buckets)
        sorted_bucket = np.repeat(np.arange(buckets), ids_per_bucket)
    rank = _rank_in_bucket(ids_per_bucket, by_bucket, sorted_bucket)
    shape = (layout.sparsecores, layout.num_sparsecores)
    ids_per_bucket = ids_per_bucket.reshape(shape)
    unique_per_bucket = unique_per_bucket.reshape(shape)
    table_ids_max, table_unique_max = _table_maxima(
        stack, bucket, embedding_id, new_column, ids_per_bucket, unique_per_bucket
    )
    keep = None
    if not allow_id_dropping:
        for limit, counts, configured in (
            ("max_ids_per_partition", ids_per_bucket, stack.max_ids_per_partition),
            ("max_unique_ids_per_partition", unique_per_bucket, stack.max_unique_ids_per_partition),
        ):
            if counts.max(initial=0) > configured:
                first_ids = runs.order[runs.starts]
                pair_feature = np.searchsorted(feature_starts, first_ids, side="right") - 1
                _raise_limit_error(
                    stack, limit, counts, configured, layout, first_sparsecore, bucket, pair_feature
                )
    elif (ids_per_bucket > stack.max_ids_per_partition).any() or (
        unique_per_bucket > stack.max_unique_ids_per_partition
    ).any():
        column_rank = _rank_in_bucket(
            unique_per_bucket.reshape(-1), by_bucket, sorted_bucket, new_column
        )
        keep = rank < stack.max_ids_per_partition
        keep &= column_rank < stack.max_unique_ids_per_partition
    pairs = MergedPairs(
        bucket=bucket,
        rank=rank,
        embedding_id=embedding_id,
        sample=runs.samples[runs.starts],
        gain=runs.gain,
        count=runs.count,
        row_group=row_group,
        row_group_key=row_group_key,
        ids_per_bucket=ids_per_bucket,
        unique_per_bucket=unique_per_bucket,
        kept_per_bucket=ids_per_bucket,
        table_ids_max=table_ids_max,
        table_unique_max=table_unique_max,
        dropped_ids=0,
    )
    return pairs if keep is None else select_pairs(pairs, keep)


def _rank_in_bucket(
    per_bucket: np.ndarray,
    by_bucket: np.ndarray | None,
    sorted_bucket: np.ndarray,
    counted: np.ndarray | None = None,
) -> np.ndarray:
    """Position of each pair among its bucket's pairs in buffer order (0-based); with the
    `counted` flags (first pair of each column), how many counted pairs of its bucket come at or
    before it, minus one: the 0-based rank of its column.

    `per_bucket` counts what is ranked per bucket; `by_bucket` is the stable order of the pairs
    by bucket (None when they are in it already) and `sorted_bucket` their buckets in it.
    """
    if counted is None:
        ranked = np.arange(len(sorted_bucket))
    else:
        ranked = np.cumsum(counted if by_bucket is None else counted[by_bucket]) - 1
    ranked -= exclusive_cumsum(per_bucket)[sorted_bucket]
    if by_bucket is None:
        return ranked
    rank = np.empty_like(ranked)
    rank[by_bucket] = ranked
    return rank


def select_pairs(pairs: MergedPairs, keep: np.ndarray) -> MergedPairs:
    """Only the pairs where `keep` holds; the rest are counted as dropped ids."""
    kept = np.bincount(pairs.bucket[keep], minlength=pairs.kept_per_bucket.size)
    return MergedPairs(
        bucket=pairs.bucket[keep],
        rank=pairs.rank[keep],
        embedding_id=pairs.embedding_id[keep],
        sample=pairs.sample[keep],
        gain=pairs.gain[keep],
        count=pairs.count[keep],
        row_group=pairs.row_group[keep] if len(pairs.row_group) else pairs.row_group,
        row_group_key=pairs.row_group_key,
        ids_per_bucket=pairs.ids_per_bucket,
        unique_per_bucket=pairs.unique_per_bucket,
        kept_per_bucket=kept.reshape(pairs.kept_per_bucket.shape),
        table_ids_max=pairs.table_ids_max,
        table_unique_max=pairs.table_unique_max,
        dropped_ids=pairs.dropped_ids + int(pairs.count[~keep].sum()),
    )
