"""Host preprocessing of one batch: ragged ids per feature -> packed buffers per stacked table.

For each stack: validate and expand every feature (`ragged`), then, chunk by chunk of this
host's SparseCores, merge and limit per partition (`partition`) and pack into the static
buffers (`pack`); then, device by device, build the unique-row side-car from the SparseCores'
columns (`unique_rows`); finally gather the stats (`stats`). Buckets never span SparseCores, so
chunks are independent: they keep the arrays small enough to stay in cache, and `preprocess` may
run them (and the devices' side-cars) on a few threads (NumPy releases the GIL in its sorts and
loops).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparsecore.layout import StackedTable
from sparsecore.preprocess.keys import KeyLayout
from sparsecore.preprocess.pack import BufferSizes, PackedBuffers, buffer_sizes, pack_chunk
from sparsecore.preprocess.partition import merge_pairs
from sparsecore.preprocess.ragged import FeatureCoordinates, RaggedIds, expand_feature
from sparsecore.preprocess.stats import PartitionStats
from sparsecore.preprocess.unique_rows import (
    SparseCoreColumns,
    UniqueRows,
    sparsecore_columns,
    write_unique_rows,
)
from sparsecore.topology import Topology

__all__ = ["PackedBatch", "preprocess", "preprocess_stack"]

CHUNK_IDS = 1 << 16
"""Ids per chunk of SparseCores to aim for. On this 2-core machine sorting and gathering cost
2-3x more per id at 300k ids than at 40k (cache), and chunks of one stack can run in parallel."""


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


@dataclass(frozen=True)
class _StackWork:
    """A stack's validated inputs, its (empty) buffers and the chunks to fill them by."""

    stack: StackedTable
    layout: KeyLayout
    features: tuple[FeatureCoordinates, ...]
    sizes: BufferSizes
    buffers: PackedBuffers
    chunks: tuple[tuple[int, int], ...]
    sparsecores_per_device: int


@dataclass(frozen=True)
class _ChunkCounts:
    """What the stats need from one chunk (per-bucket counts, per-table maxima, drops), and the
    side-car its SparseCores' columns (empty without the side-car)."""

    ids_per_bucket: np.ndarray
    unique_per_bucket: np.ndarray
    table_ids_max: tuple[int, ...]
    table_unique_max: tuple[int, ...]
    dropped_ids: int
    columns: list[SparseCoreColumns]


def _check_topology(stack: StackedTable, topology: Topology) -> None:
    if stack.num_sparsecores != topology.num_sparsecores:
        raise ValueError(
            f"stack {stack.name!r} was laid out for {stack.num_sparsecores} SparseCores but the "
            f"topology has {topology.num_sparsecores}; stack the tables again for this topology"
        )


def _chunks(num_ids: int, topology: Topology) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges of local SparseCores of about `CHUNK_IDS` ids each."""
    units = topology.local_sparsecores
    count = min(units, max(1, -(-num_ids // CHUNK_IDS)))
    bounds = [i * units // count for i in range(count + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def _prepare(
    stack: StackedTable,
    inputs: Mapping[str, RaggedIds],
    topology: Topology,
    with_unique_rows: bool,
) -> _StackWork:
    _check_topology(stack, topology)
    missing = [f for f in stack.feature_names if f not in inputs]
    if missing:
        raise ValueError(f"stack {stack.name!r}: no input for feature(s) {missing}")
    layout = KeyLayout.for_stack(stack, topology)
    features = tuple(
        expand_feature(p, stack, layout, inputs[p.feature.name], topology) for p in stack.features
    )
    sizes = buffer_sizes(stack, topology)
    return _StackWork(
        stack=stack,
        layout=layout,
        features=features,
        sizes=sizes,
        buffers=PackedBuffers.empty(sizes, topology, with_unique_rows),
        chunks=_chunks(sum(len(f.keys) for f in features), topology),
        sparsecores_per_device=topology.sparsecores_per_device,
    )


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _run_chunk(work: _StackWork, first: int, end: int, allow_id_dropping: bool) -> _ChunkCounts:
    """Merge and pack the ids of local SparseCores [first, end) into the stack's buffers."""
    spans = [(f.sparsecore_starts[first], f.sparsecore_starts[end]) for f in work.features]
    base = work.layout.base(first)
    keys = _concatenate([f.keys[lo:hi] for f, (lo, hi) in zip(work.features, spans)])
    gains = None
    if any(f.gains is not None for f in work.features):
        gains = _concatenate(
            [
                np.ones(hi - lo, np.float32) if f.gains is None else f.gains[lo:hi]
                for f, (lo, hi) in zip(work.features, spans)
            ]
        )
    layout = work.layout.chunk(first, end)
    pairs = merge_pairs(
        work.stack,
        layout,
        keys - base if base else keys,
        _concatenate([f.samples[lo:hi] for f, (lo, hi) in zip(work.features, spans)]),
        gains,
        np.cumsum([0, *(hi - lo for lo, hi in spans)])[:-1],
        allow_id_dropping,
        first_sparsecore=first,
        sparsecores_per_device=work.sparsecores_per_device,
    )
    written, slots = pack_chunk(
        work.stack, layout, pairs, work.sizes, work.buffers, first, allow_id_dropping
    )
    return _ChunkCounts(
        pairs.ids_per_bucket,
        pairs.unique_per_bucket,
        pairs.table_ids_max,
        pairs.table_unique_max,
        written.dropped_ids,
        sparsecore_columns(layout, written, slots) if work.buffers.unique is not None else [],
    )


def _finish(work: _StackWork, counts: list[_ChunkCounts]) -> PackedBatch:
    """The batch and its stats: per-device maxima over SparseCores, required buffer per
    SparseCore, per-table maxima, drops."""
    stack, layout = work.stack, work.layout
    shape = (-1, work.sparsecores_per_device, layout.num_sparsecores)
    ids = np.concatenate([c.ids_per_bucket for c in counts]).reshape(shape)
    unique = np.concatenate([c.unique_per_bucket for c in counts]).reshape(shape)
    table_ids = np.max([c.table_ids_max for c in counts], axis=0)
    table_unique = np.max([c.table_unique_max for c in counts], axis=0)
    stats = PartitionStats(
        max_ids_per_partition=ids.max(axis=1).astype(np.int32),
        max_unique_ids_per_partition=unique.max(axis=1).astype(np.int32),
        required_buffer_size_per_sparsecore=((ids + 7) & ~7).sum(axis=2).astype(np.int32),
        id_drop_count=sum(c.dropped_ids for c in counts),
        table_max_ids_per_partition=dict(zip(stack.table_names, table_ids.tolist())),
        table_max_unique_ids_per_partition=dict(zip(stack.table_names, table_unique.tolist())),
    )
    buffers = work.buffers
    return PackedBatch(
        stack=stack.name,
        sizes=work.sizes,
        row_pointers=buffers.row_pointers,
        embedding_ids=buffers.embedding_ids,
        sample_ids=buffers.sample_ids,
        gains=buffers.gains,
        stats=stats,
        unique=buffers.unique,
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
    values. `with_unique_rows` builds the CPU stand-in's side-car (`UniqueRows`); a TPU does not
    need it. `num_threads` > 1 runs chunks of SparseCores (then devices' side-cars) on that many
    threads.
    """
    known = {name for stack in stacks for name in stack.feature_names}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ValueError(f"input for unknown feature(s) {unknown}; the stacks read {sorted(known)}")
    works = [_prepare(stack, inputs, topology, with_unique_rows) for stack in stacks]
    results = _map(
        lambda task: _run_chunk(*task, allow_id_dropping),
        [(work, first, end) for work in works for first, end in work.chunks],
        num_threads,
    )
    per_stack, start = [], 0
    for work in works:
        per_stack.append(results[start : start + len(work.chunks)])
        start += len(work.chunks)
    _map(_write_side_car, [task for w, r in zip(works, per_stack) for task in _side_car_tasks(w, r)], num_threads)
    return {work.stack.name: _finish(work, counts) for work, counts in zip(works, per_stack)}


def _map(fn: Callable[[Any], Any], tasks: list[Any], num_threads: int) -> list[Any]:
    """`fn` over `tasks`, on up to `num_threads` threads."""
    if num_threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(min(num_threads, len(tasks))) as pool:
            return list(pool.map(fn, tasks))
    return [fn(task) for task in tasks]


def _side_car_tasks(
    work: _StackWork, counts: list[_ChunkCounts]
) -> list[tuple[_StackWork, int, list[SparseCoreColumns]]]:
    """One task per local device of a stack with the side-car: the device and its SparseCores'
    columns."""
    if work.buffers.unique is None:
        return []
    columns = [c for chunk in counts for c in chunk.columns]
    s = work.sparsecores_per_device
    return [(work, d, columns[d * s : (d + 1) * s]) for d in range(len(columns) // s)]


def _write_side_car(task: tuple[_StackWork, int, list[SparseCoreColumns]]) -> None:
    work, device, columns = task
    write_unique_rows(work.buffers.unique, device, columns, work.layout)


def preprocess_stack(
    stack: StackedTable,
    inputs: Mapping[str, RaggedIds],
    topology: Topology,
    allow_id_dropping: bool = False,
    with_unique_rows: bool = True,
) -> PackedBatch:
    """Preprocess the features of one stack (`inputs` by feature name; extra keys are ignored)."""
    work = _prepare(stack, inputs, topology, with_unique_rows)
    results = [_run_chunk(work, first, end, allow_id_dropping) for first, end in work.chunks]
    for task in _side_car_tasks(work, results):
        _write_side_car(task)
    return _finish(work, results)
