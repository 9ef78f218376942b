"""Host preprocessing of one batch: ragged ids per feature -> packed buffers per stacked table.

For each stack: validate and expand every feature (`ragged`), merge and limit per partition
(`partition`), pack into the static buffers (`pack`), and report stats (`stats`). Stacks are
independent, so `preprocess` may run them on a few threads (NumPy releases the GIL in its sorts
and loops).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sparsecore.layout import StackedTable
from sparsecore.preprocess.pack import BufferSizes, UniqueRows, buffer_sizes, pack_buffers
from sparsecore.preprocess.keys import KeyLayout
from sparsecore.preprocess.partition import MergedPairs, merge_pairs
from sparsecore.preprocess.ragged import RaggedIds, expand_feature
from sparsecore.preprocess.stats import PartitionStats
from sparsecore.topology import Topology

__all__ = ["PackedBatch", "preprocess", "preprocess_stack"]


@dataclass(frozen=True)
class PackedBatch:
    """One stack's batch on this host, arrays stacked over the L local devices.

    `row_pointers [L, S*R] int32`, `embedding_ids`, `sample_ids [L, C] int32`, `gains [L, C]
    float32` follow the hardware buffer semantics (see `sparsecore.preprocess.pack`); `sizes`
    gives S, R, C; `unique` is the optional stand-in side-car (`UniqueRows`).
    """

    stack: str
    sizes: BufferSizes
    row_pointers: np.ndarray
    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray
    stats: PartitionStats
    unique: UniqueRows | None


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _stats(
    stack: StackedTable, layout: KeyLayout, pairs: MergedPairs, dropped: int
) -> PartitionStats:
    """Per-device maxima over SparseCores, required buffer per SparseCore, per-table maxima."""
    shape = (layout.local_devices, layout.sparsecores_per_device, layout.num_sparsecores)
    ids = pairs.ids_per_bucket.reshape(shape)
    unique = pairs.unique_per_bucket.reshape(shape)
    return PartitionStats(
        max_ids_per_partition=ids.max(axis=1).astype(np.int32),
        max_unique_ids_per_partition=unique.max(axis=1).astype(np.int32),
        required_buffer_size_per_sparsecore=((ids + 7) & ~7).sum(axis=2).astype(np.int32),
        id_drop_count=dropped,
        table_max_ids_per_partition=dict(zip(stack.table_names, pairs.table_ids_max)),
        table_max_unique_ids_per_partition=dict(zip(stack.table_names, pairs.table_unique_max)),
    )


def _check_topology(stack: StackedTable, topology: Topology) -> None:
    if stack.num_sparsecores != topology.num_sparsecores:
        raise ValueError(
            f"stack {stack.name!r} was laid out for {stack.num_sparsecores} SparseCores but the "
            f"topology has {topology.num_sparsecores}; stack the tables again for this topology"
        )


def preprocess_stack(
    stack: StackedTable,
    inputs: Mapping[str, RaggedIds],
    topology: Topology,
    allow_id_dropping: bool = False,
    with_unique_rows: bool = True,
) -> PackedBatch:
    """Preprocess the features of one stack (`inputs` by feature name; extra keys are ignored)."""
    _check_topology(stack, topology)
    missing = [f for f in stack.feature_names if f not in inputs]
    if missing:
        raise ValueError(f"stack {stack.name!r}: no input for feature(s) {missing}")
    layout = KeyLayout.for_stack(stack, topology, sparsecore_major=not with_unique_rows)
    coordinates = [
        expand_feature(p, stack, layout, inputs[p.feature.name], topology) for p in stack.features
    ]
    feature_starts = np.cumsum([0, *(len(c.keys) for c in coordinates)])[:-1]
    gains = None
    if any(c.gains is not None for c in coordinates):
        gains = _concatenate(
            [np.ones(len(c.keys), np.float32) if c.gains is None else c.gains for c in coordinates]
        )
    pairs = merge_pairs(
        stack,
        layout,
        _concatenate([c.keys for c in coordinates]),
        _concatenate([c.samples for c in coordinates]),
        gains,
        feature_starts,
        allow_id_dropping,
        with_row_groups=with_unique_rows,
    )
    sizes = buffer_sizes(stack, topology)
    packed = pack_buffers(stack, layout, pairs, sizes, allow_id_dropping, with_unique_rows)
    return PackedBatch(
        stack=stack.name,
        sizes=sizes,
        row_pointers=packed.row_pointers,
        embedding_ids=packed.embedding_ids,
        sample_ids=packed.sample_ids,
        gains=packed.gains,
        stats=_stats(stack, layout, pairs, packed.dropped_ids),
        unique=packed.unique,
    )


def preprocess(
    stacks: Sequence[StackedTable],
    inputs: Mapping[str, RaggedIds],
    topology: Topology,
    allow_id_dropping: bool = False,
    with_unique_rows: bool = True,
    num_threads: int = 1,
) -> dict[str, PackedBatch]:
    """Preprocess one batch for every stack; `inputs` must hold exactly the stacks' features.

    With `allow_id_dropping`, ids past a partition limit or a full buffer are dropped and
    counted in `stats.id_drop_count`; without it those cases raise `PartitionLimitError` /
    `BufferOverflowError`, naming the stack, its tables and features, observed and configured
    values.
    """
    known = {name for stack in stacks for name in stack.feature_names}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ValueError(f"input for unknown feature(s) {unknown}; the stacks read {sorted(known)}")

    def run(stack: StackedTable) -> PackedBatch:
        return preprocess_stack(stack, inputs, topology, allow_id_dropping, with_unique_rows)

    if num_threads > 1 and len(stacks) > 1:
        with ThreadPoolExecutor(min(num_threads, len(stacks))) as pool:
            batches = list(pool.map(run, stacks))
    else:
        batches = [run(stack) for stack in stacks]
    return {batch.stack: batch for batch in batches}
