"""One feature's ragged ids for this host, validated and expanded to per-id SparseCore coordinates.

`RaggedIds` is the input container (values + lengths or offsets, optional weights; int32 or
int64 ids, float32 or float64 weights, all read with their real dtype). `validate_feature` checks
it against its `FeaturePlacement` (every check names the feature and the offending value) and
folds the combiner into per-id gains; `expand_feature` returns, for every id in input order, its
sort key (see `KeyLayout`), the SparseCore-local sample id and the gain, plus where each local
SparseCore's ids start (they are contiguous).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sparsecore.layout import FeaturePlacement, StackedTable
from sparsecore.preprocess.gains import combiner_gains
from sparsecore.preprocess.keys import KeyLayout
from sparsecore.topology import Topology

__all__ = [
    "FeatureCoordinates",
    "RaggedIds",
    "ValidFeature",
    "expand_feature",
    "raise_for_ids_outside_vocabulary",
    "validate_feature",
]


@dataclass(frozen=True)
class RaggedIds:
    """Ids of one feature for this host's samples: `values` of all samples concatenated, split by
    `lengths` (ids per sample) or `offsets` (sample b is values[offsets[b]:offsets[b+1]]),
    with optional per-id `weights`. Give exactly one of `lengths` and `offsets`."""

    values: np.ndarray
    lengths: np.ndarray | None = None
    offsets: np.ndarray | None = None
    weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.lengths is None) == (self.offsets is None):
            raise ValueError("RaggedIds needs exactly one of `lengths` and `offsets`")
        for field in ("values", "lengths", "offsets", "weights"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, np.asarray(value))

    @classmethod
    def from_dense(cls, ids: np.ndarray, weights: np.ndarray | None = None) -> RaggedIds:
        """Every sample has the same number of ids: a [batch, width] array."""
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(
                f"RaggedIds.from_dense expects [batch, width] ids, got shape {ids.shape}"
            )
        lengths = np.full(ids.shape[0], ids.shape[1], dtype=np.int64)
        flat_weights = None if weights is None else np.asarray(weights).reshape(-1)
        return cls(ids.reshape(-1), lengths=lengths, weights=flat_weights)

    @classmethod
    def from_rows(
        cls, rows: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None = None
    ) -> RaggedIds:
        """One array of ids per sample (and of weights, if given); dtypes are kept."""
        rows = [np.asarray(r).reshape(-1) for r in rows]
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        values = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32)
        flat_weights = None
        if weights is not None:
            weights = [np.asarray(w).reshape(-1) for w in weights]
            flat_weights = np.concatenate(weights) if weights else np.zeros(0, dtype=np.float32)
        return cls(values, lengths=lengths, weights=flat_weights)


@dataclass(frozen=True)
class ValidFeature:
    """One feature's host-local input, checked: `values` (1-D int32 or int64, inside the
    vocabulary), `lengths` (int64 ids per sample or output row group, one per host sample) and
    float32 combiner `gains` per id (None: all 1)."""

    placement: FeaturePlacement
    values: np.ndarray
    lengths: np.ndarray
    gains: np.ndarray | None


@dataclass(frozen=True)
class FeatureCoordinates:
    """Per id of one feature, in input order: sort key, SparseCore-local sample id and gain
    (None: all 1). The ids of local SparseCore c are [sparsecore_starts[c],
    sparsecore_starts[c + 1])."""

    keys: np.ndarray
    samples: np.ndarray
    gains: np.ndarray | None
    sparsecore_starts: np.ndarray


def _lengths(name: str, ids: RaggedIds, num_samples: int) -> np.ndarray:
    num_values = ids.values.shape[0]
    if ids.offsets is not None:
        offsets = ids.offsets
        if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
            raise ValueError(
                f"feature {name!r}: offsets must be a 1-D integer array, "
                f"got {offsets.dtype}{offsets.shape}"
            )
        if len(offsets) != num_samples + 1:
            raise ValueError(
                f"feature {name!r}: expected {num_samples + 1} offsets for {num_samples} "
                f"samples on this host, got {len(offsets)}"
            )
        if offsets[0] != 0 or offsets[-1] != num_values:
            raise ValueError(
                f"feature {name!r}: offsets must run from 0 to the {num_values} values, "
                f"got {int(offsets[0])}..{int(offsets[-1])}"
            )
        lengths = np.diff(offsets.astype(np.int64))
    else:
        lengths = ids.lengths
        if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"feature {name!r}: lengths must be a 1-D integer array, "
                f"got {lengths.dtype}{lengths.shape}"
            )
        if len(lengths) != num_samples:
            raise ValueError(
                f"feature {name!r}: expected {num_samples} samples on this host, "
                f"got {len(lengths)} lengths"
            )
        lengths = lengths.astype(np.int64)
    negative = np.flatnonzero(lengths < 0)
    if len(negative):
        raise ValueError(
            f"feature {name!r}: sample {int(negative[0])} has negative length "
            f"{int(lengths[negative[0]])}"
        )
    if ids.offsets is None and lengths.sum() != num_values:
        raise ValueError(
            f"feature {name!r}: lengths sum to {int(lengths.sum())} but there are "
            f"{num_values} values"
        )
    return lengths


def _check_values(
    name: str, ids: RaggedIds, vocabulary_size: int, table: str, check_range: bool = True
) -> np.ndarray:
    values = ids.values
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"feature {name!r}: ids must be a 1-D integer array, got {values.dtype}{values.shape}"
        )
    if check_range and len(values) and (values.min() < 0 or values.max() >= vocabulary_size):
        bad = np.flatnonzero((values < 0) | (values >= vocabulary_size))[0]
        raise ValueError(
            f"feature {name!r}: id {int(values[bad])} (position {int(bad)}) is outside the "
            f"vocabulary [0, {vocabulary_size}) of table {table!r}"
        )
    return values if values.dtype in (np.int32, np.int64) else values.astype(np.int64)


def _check_weights(name: str, ids: RaggedIds) -> np.ndarray | None:
    weights = ids.weights
    if weights is None:
        return None
    if weights.shape != ids.values.shape or not np.issubdtype(weights.dtype, np.floating):
        raise ValueError(
            f"feature {name!r}: weights must be floats shaped like the ids {ids.values.shape}, "
            f"got {weights.dtype}{weights.shape}"
        )
    weights = weights.astype(np.float32)
    if not np.isfinite(weights).all():
        bad = np.flatnonzero(~np.isfinite(weights))[0]
        raise ValueError(
            f"feature {name!r}: weight {weights[bad]} at position {int(bad)} is not finite"
        )
    return weights


def _row_coordinates(
    rows: np.ndarray, placement: FeaturePlacement, layout: KeyLayout
) -> tuple[np.ndarray, np.ndarray]:
    """For output rows of one feature on this host: the key bits of their local SparseCore, and
    their SparseCore-local sample ids."""
    local_sc = rows // placement.samples_per_sparsecore
    sample = rows - local_sc * placement.samples_per_sparsecore
    sample += placement.sample_offset_in_sparsecore
    return layout.sparsecore_part(local_sc), sample.astype(np.int32)


def _check_sequence_lengths(name: str, lengths: np.ndarray, max_sequence_length: int) -> None:
    longest = int(lengths.max()) if len(lengths) else 0
    if longest > max_sequence_length:
        raise ValueError(
            f"feature {name!r}: sample {int(np.argmax(lengths))} has {longest} ids, more than its "
            f"max_sequence_length {max_sequence_length}"
        )


def _sequence_rows(lengths: np.ndarray, max_sequence_length: int) -> np.ndarray:
    """Output row of every id of a sequence feature: sample * M + position in the sample."""
    starts = np.cumsum(lengths) - lengths
    positions = np.arange(lengths.sum(), dtype=np.int64) - np.repeat(starts, lengths)
    samples = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return samples * max_sequence_length + positions


def validate_feature(
    placement: FeaturePlacement,
    stack: StackedTable,
    ids: RaggedIds,
    topology: Topology,
    check_id_range: bool = True,
) -> ValidFeature:
    """Check one feature's host-local input (the host holds `batch * L / G` samples) and fold
    its combiner into per-id gains (weights are rounded to float32). `check_id_range=False`
    leaves ids outside the vocabulary to the caller (the compiled path checks them as it reads
    them; `raise_for_ids_outside_vocabulary` then raises this check's error)."""
    feature = placement.feature
    name = feature.name
    num_samples = feature.batch_size * topology.local_device_count // topology.global_device_count
    table = stack.tables[placement.table_index]
    values = _check_values(name, ids, table.table.vocabulary_size, table.table.name, check_id_range)
    lengths = _lengths(name, ids, num_samples)
    weights = _check_weights(name, ids)
    if feature.is_sequence:
        _check_sequence_lengths(name, lengths, feature.max_sequence_length)
    gains = combiner_gains(name, stack.combiner, lengths, weights, pooled=not feature.is_sequence)
    return ValidFeature(placement, values, lengths, gains)


def raise_for_ids_outside_vocabulary(valid: ValidFeature) -> None:
    """Raise `validate_feature`'s error if a validated feature has an id outside its table's
    vocabulary."""
    feature = valid.placement.feature
    ids = RaggedIds(valid.values, lengths=valid.lengths)
    _check_values(feature.name, ids, feature.table.vocabulary_size, feature.table.name)


def expand_feature(
    valid: ValidFeature, stack: StackedTable, layout: KeyLayout, topology: Topology
) -> FeatureCoordinates:
    """Map every id of a validated feature to its SparseCore coordinates.

    Local SparseCore c (device c // S) gets the slice of output rows [c * q, (c + 1) * q) with
    q = `samples_per_sparsecore`.
    """
    placement = valid.placement
    feature = placement.feature
    n = topology.num_sparsecores
    lengths = valid.lengths
    per_sparsecore = placement.samples_per_sparsecore
    sparsecore_rows = np.arange(topology.local_sparsecores + 1) * per_sparsecore
    if feature.is_sequence:
        rows = _sequence_rows(lengths, feature.max_sequence_length)
        row_keys, samples = _row_coordinates(rows, placement, layout)
        sparsecore_starts = np.searchsorted(rows, sparsecore_rows)
    else:
        row_keys, samples = _row_coordinates(np.arange(len(lengths)), placement, layout)
        row_keys, samples = np.repeat(row_keys, lengths), np.repeat(samples, lengths)
        sparsecore_starts = np.concatenate([[0], np.cumsum(lengths)])[sparsecore_rows]
    values = valid.values.astype(layout.dtype, copy=False)
    partition = (values + placement.col_shift) & (n - 1)
    table = stack.tables[placement.table_index]
    keys = layout.id_part(partition, (values >> (n.bit_length() - 1)) + table.row_offset_in_shard)
    keys |= row_keys
    return FeatureCoordinates(keys, samples, valid.gains, sparsecore_starts)
