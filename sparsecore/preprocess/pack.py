"""Pack merged (sample, column) pairs into the static per-device buffers the kernels read.

Per local device: `row_pointers [S*R]`, and `embedding_ids`, `sample_ids`, `gains` of length C.
SparseCore s owns the segment [s*C/S, (s+1)*C/S); in it partitions 0..N-1 follow in order,
each starting at the previous end rounded up to 8, entries sorted by (embedding id, sample).
Row-pointer slot p of SparseCore s holds the UNROUNDED end of partition p relative to the segment
start; slots N..R-1 hold the rounded end of the last partition. Slots not holding an entry are
pads (ids 2^31-1, gain NaN) -- also past the defined prefix, where the reference leaves garbage.
These are the semantics of jax-tpu-embedding 0.2.0 (see tests/sparsecore/golden/.../README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsecore.layout import StackedTable, round_up
from sparsecore.preprocess.keys import KeyLayout
from sparsecore.preprocess.partition import MergedPairs, select_pairs
from sparsecore.preprocess.unique_rows import UniqueRows
from sparsecore.topology import Topology

__all__ = [
    "PAD_ID",
    "BufferOverflowError",
    "BufferSizes",
    "PackedBuffers",
    "buffer_sizes",
    "pack_chunk",
    "raise_buffer_overflow",
]

PAD_ID = 2**31 - 1
"""Embedding and sample id of pad slots (gain NaN)."""


@dataclass(frozen=True)
class BufferSizes:
    """Static sizes of one stack's buffers on one device (they fix the compiled shapes)."""

    sparsecores_per_device: int
    row_pointers_per_sparsecore: int
    coo_buffer_size_per_device: int
    batch_size_per_sparsecore: int
    unique_rows_per_partition: int

    @property
    def row_pointers_size_per_device(self) -> int:
        return self.sparsecores_per_device * self.row_pointers_per_sparsecore

    @property
    def coo_buffer_size_per_sparsecore(self) -> int:
        return self.coo_buffer_size_per_device // self.sparsecores_per_device


def buffer_sizes(stack: StackedTable, topology: Topology) -> BufferSizes:
    """C = round8(max_ids_per_partition) * S * N, or the stack's suggested size rounded up to 8S.

    `unique_rows_per_partition` U = round8(min(S * max_unique_ids, rows_per_shard)) bounds the
    distinct rows one device looks up in one partition (each of its S SparseCores sends at most
    max_unique_ids distinct columns there).
    """
    per_device = topology.sparsecores_per_device
    if stack.suggested_coo_buffer_size_per_device is not None:
        coo = round_up(stack.suggested_coo_buffer_size_per_device, 8 * per_device)
    else:
        coo = round_up(stack.max_ids_per_partition, 8) * per_device * topology.num_sparsecores
    unique = min(per_device * stack.max_unique_ids_per_partition, stack.rows_per_shard)
    return BufferSizes(
        sparsecores_per_device=per_device,
        row_pointers_per_sparsecore=topology.row_pointers_per_sparsecore,
        coo_buffer_size_per_device=coo,
        batch_size_per_sparsecore=stack.batch_size_per_sparsecore,
        unique_rows_per_partition=round_up(unique, 8),
    )


class BufferOverflowError(ValueError):
    """A SparseCore's entries do not fit its segment of the COO buffer, with dropping off."""

    def __init__(
        self, stack: StackedTable, sizes: BufferSizes, device: int, sparsecore: int, needed: int
    ) -> None:
        self.stack, self.device, self.sparsecore = stack.name, device, sparsecore
        self.needed, self.capacity = needed, sizes.coo_buffer_size_per_sparsecore
        super().__init__(
            f"stacked table {stack.name!r} (tables {', '.join(stack.table_names)}; features "
            f"{', '.join(stack.feature_names)}): local device {device}, SparseCore {sparsecore} "
            f"needs {needed} COO slots but its segment holds {self.capacity} "
            f"(coo_buffer_size_per_device {sizes.coo_buffer_size_per_device} from "
            f"suggested_coo_buffer_size_per_device={stack.suggested_coo_buffer_size_per_device}). "
            "Raise the suggested buffer size or enable allow_id_dropping."
        )


@dataclass(frozen=True)
class PackedBuffers:
    """One stack's buffers for this host (leading dim L), preset to pads and filled chunk by
    chunk of local SparseCores; `unique` is present when the side-car is built."""

    row_pointers: np.ndarray
    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray
    unique: UniqueRows | None

    @classmethod
    def empty(
        cls, sizes: BufferSizes, topology: Topology, with_unique_rows: bool, preset: bool = True
    ) -> PackedBuffers:
        """The buffers preset to pads (zero row pointers and counts), or, with `preset` false,
        uninitialised, for a writer that fills every slot. They share one allocation (see
        `_aligned_arrays`)."""
        devices, n = topology.local_device_count, topology.num_sparsecores
        coo = (devices, sizes.coo_buffer_size_per_device)
        shapes = [coo, coo, coo, (devices, sizes.row_pointers_size_per_device)]
        if with_unique_rows:
            shapes += [coo, (devices, n, sizes.unique_rows_per_partition), (devices, n)]
        arrays = _aligned_arrays(shapes)
        embedding_ids, sample_ids, gains, row_pointers = arrays[0], arrays[1], arrays[2].view(np.float32), arrays[3]
        unique = None
        if with_unique_rows:
            unique = UniqueRows(unique_ids=arrays[5], unique_counts=arrays[6], entry_unique_index=arrays[4])
        if preset:
            for array, value in ((embedding_ids, PAD_ID), (sample_ids, PAD_ID), (gains, np.nan), (row_pointers, 0)):
                array.fill(value)
            if unique is not None:
                unique.entry_unique_index.fill(PAD_ID)
                unique.unique_ids.fill(PAD_ID)
                unique.unique_counts.fill(0)
        return cls(row_pointers, embedding_ids, sample_ids, gains, unique)


_ALIGNMENT = 64


def _aligned_arrays(shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Uninitialised int32 arrays of `shapes`, carved from one allocation, each starting on a
    64-byte boundary. One allocation: at the benchmark's sizes it crosses the 4 MiB from which
    NumPy asks for transparent huge pages (first writes into fresh small pages cost about as much
    as the compiled preprocessing itself). Alignment: JAX puts a 64-byte aligned host array on
    a CPU device without copying it."""
    sizes = [int(np.prod(shape)) * 4 for shape in shapes]
    starts = np.cumsum([0, *(-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes)])
    memory = np.empty(int(starts[-1]) + _ALIGNMENT, np.uint8)
    base = -memory.ctypes.data % _ALIGNMENT
    return [
        memory[base + start : base + start + size].view(np.int32).reshape(shape)
        for start, size, shape in zip(starts.tolist(), sizes, shapes)
    ]


def raise_buffer_overflow(stack: StackedTable, sizes: BufferSizes, kept: np.ndarray, first: int) -> None:
    """Raise `BufferOverflowError` for the SparseCore (of local SparseCores `first`, ... with
    `kept[s, p]` pairs per partition) that needs the most slots."""
    needed = ((kept + 7) & ~7).sum(axis=1)
    device, sparsecore = divmod(first + int(np.argmax(needed)), sizes.sparsecores_per_device)
    raise BufferOverflowError(stack, sizes, device, sparsecore, int(needed.max()))


def pack_chunk(
    stack: StackedTable,
    layout: KeyLayout,
    pairs: MergedPairs,
    sizes: BufferSizes,
    buffers: PackedBuffers,
    first: int,
    allow_id_dropping: bool,
) -> tuple[MergedPairs, np.ndarray]:
    """Write a chunk's `pairs` (local SparseCores from `first` on) into `buffers`, each bucket's
    pairs from its start on; return the pairs written and their slots (flat over the host's
    devices).

    If a SparseCore's entries overflow its segment, filling stops at the segment end (later
    partitions get no entries, their row pointers equal the segment length) and the raw ids not
    written are counted as dropped -- only with `allow_id_dropping`; otherwise
    `BufferOverflowError`.
    """
    n = layout.num_sparsecores
    segment = sizes.coo_buffer_size_per_sparsecore
    kept = pairs.kept_per_bucket
    rounded = (kept + 7) & ~7
    starts = np.cumsum(rounded, axis=1) - rounded
    ends = starts + kept
    if ends[:, -1].max(initial=0) > segment:
        if not allow_id_dropping:
            raise_buffer_overflow(stack, sizes, kept, first)
        starts, ends = np.minimum(starts, segment), np.minimum(ends, segment)
        bucket = pairs.bucket_of_pairs()
        rank = np.arange(len(pairs.keys)) - pairs.bucket_starts[bucket]
        pairs = select_pairs(pairs, rank < (ends - starts).reshape(-1)[bucket], layout)
    chunk = slice(first, first + len(kept))
    offsets = (np.arange(first, chunk.stop)[:, None] * segment + starts).reshape(-1)
    slots = np.arange(len(pairs.keys)) + np.repeat(
        offsets - pairs.bucket_starts[:-1], np.diff(pairs.bucket_starts)
    )
    buffers.embedding_ids.reshape(-1)[slots] = layout.row(pairs.keys)
    buffers.sample_ids.reshape(-1)[slots] = pairs.samples
    buffers.gains.reshape(-1)[slots] = pairs.gains
    row_pointers = buffers.row_pointers.reshape(-1, sizes.row_pointers_per_sparsecore)
    row_pointers[chunk, :n] = ends
    row_pointers[chunk, n:] = (ends[:, -1:] + 7) & ~7
    return pairs, slots
