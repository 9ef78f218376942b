"""Host preprocessing of one batch: ragged ids per feature -> packed buffers per stacked table.

For each stack: validate every feature and fold its combiner into gains (`ragged`, `gains`),
then fill the buffers by one of two paths that give the same results:

* compiled (`native`): one call maps, sorts, merges, limits and packs the ids of every local
  device (the SparseCores on C++ threads, without the GIL), and another writes the side-cars;
* NumPy: every feature expanded to sort keys (`ragged`), then, chunk by chunk of this host's
  SparseCores, merge and limit per partition (`partition`) and pack (`pack`); then, device by
  device, the unique-row side-car from the SparseCores' columns (`unique_rows`). Buckets never
  span SparseCores, so chunks are independent: they keep the arrays small enough to stay in
  cache (NumPy releases the GIL in its sorts and loops).

Either way the tasks may run on a few threads, and the stats are gathered last (`stats`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from sparsecore.layout import StackedTable
from sparsecore.preprocess.keys import KeyLayout
from sparsecore.preprocess import native
from sparsecore.preprocess.pack import (
    BufferSizes,
    PackedBuffers,
    buffer_sizes,
    pack_chunk,
    raise_buffer_overflow,
)
from sparsecore.preprocess.partition import check_limits, merge_pairs
from sparsecore.preprocess.ragged import (
    FeatureCoordinates,
    RaggedIds,
    ValidFeature,
    expand_feature,
    raise_for_ids_outside_vocabulary,
    validate_feature,
)
from sparsecore.preprocess.stats import PartitionStats
from sparsecore.preprocess.unique_rows import (
    SparseCoreColumns,
    UniqueRows,
    sparsecore_columns,
    write_unique_rows,
)
from sparsecore.topology import Topology

__all__ = ["Implementation", "PackedBatch", "preprocess", "preprocess_stack"]

CHUNK_IDS = 1 << 16
"""Ids per chunk of SparseCores to aim for. On this 2-core machine sorting and gathering cost
2-3x more per id at 300k ids than at 40k (cache), and chunks of one stack can run in parallel."""


@dataclass(frozen=True)
class PackedBatch:
    """One stack's batch on this host, arrays stacked over the L local devices.

    `row_pointers [L, S*R] int32`, `embedding_ids`, `sample_ids [L, C] int32`, `gains [L, C]
    float32` follow the hardware buffer semantics (see `sparsecore.preprocess.pack`); `sizes`
    gives S, R, C; `unique` is the optional stand-in side-car (`UniqueRows`). The arrays are
    64-byte aligned, so on a CPU device JAX may use them in place rather than copy them: do not
    write into a batch once it is on a device.
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
    """A stack's validated inputs and its (empty) buffers."""

    stack: StackedTable
    layout: KeyLayout
    features: tuple[ValidFeature, ...]
    sizes: BufferSizes
    buffers: PackedBuffers
    sparsecores_per_device: int


@dataclass(frozen=True)
class _ChunkCounts:
    """What the stats need from one chunk of local SparseCores (per-bucket counts `[SparseCores,
    N]`, per-table maxima, drops), and, on the NumPy path, the side-car columns of its
    SparseCores."""

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
    compiled: bool,
) -> _StackWork:
    """Validate the stack's inputs and allocate its buffers; for the `compiled` path, which
    checks ids against the vocabulary as it reads them and writes every slot, those two steps
    are left to it."""
    _check_topology(stack, topology)
    missing = [f for f in stack.feature_names if f not in inputs]
    if missing:
        raise ValueError(f"stack {stack.name!r}: no input for feature(s) {missing}")
    sizes = buffer_sizes(stack, topology)
    return _StackWork(
        stack=stack,
        layout=KeyLayout.for_stack(stack, topology),
        features=tuple(
            validate_feature(p, stack, inputs[p.feature.name], topology, check_id_range=not compiled)
            for p in stack.features
        ),
        sizes=sizes,
        buffers=PackedBuffers.empty(sizes, topology, with_unique_rows, preset=not compiled),
        sparsecores_per_device=topology.sparsecores_per_device,
    )


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


@dataclass(frozen=True)
class _Plan:
    """A stack's work as tasks: the `chunks` fill the buffers, independently of each other, on
    up to `threads` Python threads; then `settle(results)`, given their results in order, raises
    the first error they report and returns each chunk's counts for the stats and the tasks that
    build the side-car (none without one)."""

    chunks: list[Callable[[], Any]]
    threads: int
    settle: Callable[[list[Any]], tuple[list[_ChunkCounts], list[Callable[[], None]]]]


def _numpy_plan(work: _StackWork, topology: Topology, allow_id_dropping: bool, num_threads: int) -> _Plan:
    """The NumPy path: every feature expanded to coordinates, one task per chunk of local
    SparseCores (raising its errors), then one side-car task per device from the chunks'
    columns."""
    features = tuple(expand_feature(f, work.stack, work.layout, topology) for f in work.features)
    chunks = _chunks(sum(len(f.keys) for f in features), topology)

    def settle(results: list[_ChunkCounts]) -> tuple[list[_ChunkCounts], list[Callable[[], None]]]:
        if work.buffers.unique is None:
            return results, []
        columns = [c for chunk in results for c in chunk.columns]
        s = work.sparsecores_per_device
        return results, [
            functools.partial(write_unique_rows, work.buffers.unique, d, columns[d * s : (d + 1) * s], work.layout)
            for d in range(topology.local_device_count)
        ]

    return _Plan(
        [functools.partial(_run_chunk, work, features, first, end, allow_id_dropping) for first, end in chunks],
        num_threads,
        settle,
    )


def _run_chunk(
    work: _StackWork, features: tuple[FeatureCoordinates, ...], first: int, end: int, allow_id_dropping: bool
) -> _ChunkCounts:
    """Merge and pack the ids of local SparseCores [first, end) into the stack's buffers."""
    spans = [(f.sparsecore_starts[first], f.sparsecore_starts[end]) for f in features]
    base = work.layout.base(first)
    keys = _concatenate([f.keys[lo:hi] for f, (lo, hi) in zip(features, spans)])
    gains = None
    if any(f.gains is not None for f in features):
        gains = _concatenate(
            [
                np.ones(hi - lo, np.float32) if f.gains is None else f.gains[lo:hi]
                for f, (lo, hi) in zip(features, spans)
            ]
        )
    layout = work.layout.chunk(first, end)
    pairs = merge_pairs(
        work.stack,
        layout,
        keys - base if base else keys,
        _concatenate([f.samples[lo:hi] for f, (lo, hi) in zip(features, spans)]),
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


def _native_plan(work: _StackWork, topology: Topology, allow_id_dropping: bool, num_threads: int) -> _Plan:
    """The compiled path (`native`): one task, which packs every local device's SparseCores on
    `num_threads` C++ threads; then, device by device, its errors, and the side-cars."""
    features = tuple(native.native_feature(f, work.stack) for f in work.features)
    call = native.stack_call(work.stack, features, work.sizes, work.buffers, work.layout.row_bits, allow_id_dropping)

    def settle(results: list[native.SparseCoreCounts]) -> tuple[list[_ChunkCounts], list[Callable[[], None]]]:
        (counts,) = results
        s = work.sparsecores_per_device
        if (counts.statuses != native.OK).any():
            for first in range(0, len(counts.statuses), s):
                _raise_native_errors(work, topology, counts.select(first, first + s), first)
        chunk = _ChunkCounts(
            counts.ids_per_bucket,
            counts.unique_per_bucket,
            tuple(counts.table_ids_max.max(axis=0).tolist()),
            tuple(counts.table_unique_max.max(axis=0).tolist()),
            int(counts.dropped_ids.sum()),
            [],
        )
        if work.buffers.unique is None:
            return [chunk], []
        return [chunk], [functools.partial(native.side_car, call, work.stack, num_threads)]

    return _Plan([functools.partial(native.pack, call, work.stack, num_threads)], 1, settle)


def _raise_native_errors(work: _StackWork, topology: Topology, counts: native.SparseCoreCounts, first: int) -> None:
    """Raise what the NumPy path raises for the device of local SparseCores `first`, ... if
    its SparseCores report an id outside the vocabulary, a limit exceeded or a full buffer (in
    that order)."""
    if (counts.statuses == native.ID_OUT_OF_RANGE).any():
        for feature in work.features:
            raise_for_ids_outside_vocabulary(feature)
        raise RuntimeError(
            f"stack {work.stack.name!r}: the compiled path saw an id outside the vocabulary that "
            "the NumPy check does not (a preprocessing bug)"
        )
    if (counts.statuses == native.LIMIT_EXCEEDED).any():
        buckets = first * work.layout.num_sparsecores
        check_limits(
            work.stack,
            counts.ids_per_bucket,
            counts.unique_per_bucket,
            first,
            work.sparsecores_per_device,
            lambda b: _features_in_bucket(work, topology, buckets + b),
        )
    if (counts.statuses == native.BUFFER_OVERFLOW).any():
        raise_buffer_overflow(work.stack, work.sizes, counts.kept_per_bucket, first)


def _features_in_bucket(work: _StackWork, topology: Topology, bucket: int) -> list[int]:
    """Indices of the stack's features with ids in local bucket `bucket` (SparseCore * N +
    partition over the host's SparseCores): for an error message, so computed the plain way."""
    return [
        index
        for index, feature in enumerate(work.features)
        if (work.layout.bucket(expand_feature(feature, work.stack, work.layout, topology).keys) == bucket).any()
    ]


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


Implementation = Literal["auto", "native", "numpy"]
"""How `preprocess` computes: "native" the compiled path (`sparsecore.preprocess.native`),
"numpy" the NumPy path, "auto" the compiled path where it builds, else NumPy with a warning.
Both give the same buffers, stats and errors (an input with several faults may have a different
one named first: the compiled path checks ids against the vocabulary last)."""


def _native_selected(implementation: Implementation) -> bool:
    if implementation == "numpy":
        return False
    if implementation == "native":
        error = native.build_error()
        if error is not None:
            raise RuntimeError(f"compiled preprocessing is unavailable: {error}")
        return True
    if implementation != "auto":
        raise ValueError(f"implementation must be 'auto', 'native' or 'numpy', got {implementation!r}")
    return _auto_native()


@functools.cache
def _auto_native() -> bool:
    error = native.build_error()
    if error is not None:
        warnings.warn(
            f"sparsecore: compiled host preprocessing is unavailable ({error.splitlines()[0]}); "
            "preprocessing with NumPy (same results, several times slower)",
            stacklevel=4,
        )
    return error is None


def preprocess(
    stacks: Sequence[StackedTable],
    inputs: Mapping[str, RaggedIds],
    topology: Topology,
    allow_id_dropping: bool = False,
    with_unique_rows: bool = True,
    num_threads: int = 1,
    implementation: Implementation = "auto",
) -> dict[str, PackedBatch]:
    """Preprocess one batch for every stack; `inputs` must hold exactly the stacks' features.

    With `allow_id_dropping`, ids past a partition limit or a full buffer are dropped and
    counted in `stats.id_drop_count`; without it those cases raise `PartitionLimitError` /
    `BufferOverflowError`, naming the stack, its tables and features, observed and configured
    values. `with_unique_rows` builds the CPU stand-in's side-car (`UniqueRows`); a TPU does not
    need it. `num_threads` > 1 runs the work (SparseCores or chunks of them, then side-cars) on
    that many threads (C++ threads on the compiled path). `implementation`: see
    `Implementation`.
    """
    known = {name for stack in stacks for name in stack.feature_names}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ValueError(f"input for unknown feature(s) {unknown}; the stacks read {sorted(known)}")
    compiled = _native_selected(implementation)
    make_plan = _native_plan if compiled else _numpy_plan
    works = [_prepare(stack, inputs, topology, with_unique_rows, compiled) for stack in stacks]
    plans = [make_plan(work, topology, allow_id_dropping, num_threads) for work in works]
    settled = [plan.settle(_map(plan.chunks, plan.threads)) for plan in plans]
    for plan, (_, side_cars) in zip(plans, settled):
        _map(side_cars, plan.threads)
    return {work.stack.name: _finish(work, counts) for work, (counts, _) in zip(works, settled)}


def _map(tasks: list[Callable[[], Any]], num_threads: int) -> list[Any]:
    """The results of `tasks`, run on up to `num_threads` threads."""
    if num_threads > 1 and len(tasks) > 1:
        return list(_executor(num_threads).map(lambda task: task(), tasks))
    return [task() for task in tasks]


@functools.cache
def _executor(num_threads: int) -> ThreadPoolExecutor:
    """One pool per thread count, kept for the process: starting threads every batch would
    cost more than small batches' work."""
    return ThreadPoolExecutor(num_threads, thread_name_prefix="sparsecore-preprocess")


def preprocess_stack(
    stack: StackedTable,
    inputs: Mapping[str, RaggedIds],
    topology: Topology,
    allow_id_dropping: bool = False,
    with_unique_rows: bool = True,
    implementation: Implementation = "auto",
) -> PackedBatch:
    """Preprocess the features of one stack (`inputs` by feature name; extra keys are ignored)."""
    compiled = _native_selected(implementation)
    make_plan = _native_plan if compiled else _numpy_plan
    work = _prepare(stack, inputs, topology, with_unique_rows, compiled)
    plan = make_plan(work, topology, allow_id_dropping, 1)
    counts, side_cars = plan.settle([task() for task in plan.chunks])
    for task in side_cars:
        task()
    return _finish(work, counts)
