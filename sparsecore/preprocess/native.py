"""Compiled host preprocessing: one stack's validated features -> its packed buffers.

`csrc/pack.cc` computes what `partition.merge_pairs`, `pack.pack_chunk` and `unique_rows`
compute with NumPy, with the same results bit for bit, in a few passes over each SparseCore's
ids that stay in the caches instead of a sequence of whole-array NumPy calls: `pack` maps the
ids to (SparseCore, partition), sorts each partition by row, merges pairs, counts, applies the
limits and writes the buffers of every local device, SparseCore by SparseCore on its own
threads; `side_car` then builds each device's unique-row side-car from the written buffers,
partition by partition. One call of each per stack: the threads are C++ threads (Python threads
would queue for the GIL between calls), and a call per device cost more than the work of a small
stack on many devices. Limits and a full buffer come back as statuses with the counts;
`pipeline` raises the NumPy path's exceptions from them.

The library is built on first use (`sparsecore.native`); `build_error` tells whether it can be.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from sparsecore import native
from sparsecore.layout import StackedTable
from sparsecore.preprocess.pack import PAD_ID, BufferSizes, PackedBuffers
from sparsecore.preprocess.ragged import ValidFeature

__all__ = [
    "BUFFER_OVERFLOW",
    "ID_OUT_OF_RANGE",
    "LIMIT_EXCEEDED",
    "OK",
    "NativeFeature",
    "SparseCoreCounts",
    "StackCall",
    "build_error",
    "native_feature",
    "pack",
    "side_car",
    "stack_call",
]

_SOURCE = Path(__file__).parent / "csrc" / "pack.cc"

OK, LIMIT_EXCEEDED, BUFFER_OVERFLOW, SIDE_CAR_OVERFLOW, OUT_OF_MEMORY, ID_OUT_OF_RANGE = range(6)
"""The C++ functions' statuses."""

_i64 = ctypes.c_int64
_p = ctypes.c_void_p


class _FeatureInput(ctypes.Structure):
    _fields_ = [
        ("values", _p), ("values_are_int64", _i64), ("offsets", _p), ("gains", _p),
        ("num_samples", _i64), ("samples_per_sparsecore", _i64), ("sample_offset", _i64),
        ("col_shift", _i64), ("row_offset_in_shard", _i64), ("max_sequence_length", _i64),
        ("vocabulary_size", _i64),
    ]


class _StackParams(ctypes.Structure):
    _fields_ = [
        ("num_sparsecores", _i64), ("sparsecores_per_device", _i64),
        ("row_bits", _i64), ("row_pointers_per_sparsecore", _i64), ("segment", _i64),
        ("unique_width", _i64), ("max_ids", _i64), ("max_unique", _i64),
        ("allow_dropping", _i64), ("num_tables", _i64), ("table_row_starts", _p), ("pad_id", _i64),
        ("sample_bits", _i64),
    ]


class _HostBuffers(ctypes.Structure):
    _fields_ = [
        ("row_pointers", _p), ("embedding_ids", _p), ("sample_ids", _p), ("gains", _p),
        ("unique_ids", _p), ("unique_counts", _p), ("entry_unique_index", _p),
    ]


class _HostCounts(ctypes.Structure):
    _fields_ = [
        ("ids_per_bucket", _p), ("unique_per_bucket", _p), ("kept_per_bucket", _p),
        ("table_ids_max", _p), ("table_unique_max", _p), ("dropped_ids", _p), ("statuses", _p),
    ]


@functools.cache
def _library() -> ctypes.CDLL:
    library = native.library(_SOURCE)
    library.sparsecore_pack.argtypes = [
        ctypes.POINTER(_StackParams), ctypes.POINTER(_FeatureInput), _i64,
        ctypes.POINTER(_HostBuffers), ctypes.POINTER(_HostCounts), _i64, _i64,
    ]
    library.sparsecore_pack.restype = ctypes.c_int32
    library.sparsecore_side_car.argtypes = [ctypes.POINTER(_StackParams), ctypes.POINTER(_HostBuffers), _i64, _i64]
    library.sparsecore_side_car.restype = ctypes.c_int32
    return library


def build_error() -> str | None:
    """Why the compiled preprocessing cannot be built or loaded here, or None (it is built on
    the first call)."""
    try:
        _library()
    except (OSError, RuntimeError) as error:
        return str(error)
    return None


@dataclass(frozen=True)
class SparseCoreCounts:
    """What `pack` reports for a range of local SparseCores, per SparseCore: status, pairs /
    columns per partition before dropping and pairs within the limits (`[G, N]`), per-table
    maxima (`[G, T]`) and raw ids dropped (`[G]`)."""

    statuses: np.ndarray
    ids_per_bucket: np.ndarray
    unique_per_bucket: np.ndarray
    kept_per_bucket: np.ndarray
    table_ids_max: np.ndarray
    table_unique_max: np.ndarray
    dropped_ids: np.ndarray

    def select(self, first: int, end: int) -> SparseCoreCounts:
        """The counts of local SparseCores [first, end)."""
        return SparseCoreCounts(*(getattr(self, f.name)[first:end] for f in fields(self)))


@dataclass(frozen=True)
class NativeFeature:
    """A validated feature with the arrays the C++ reads kept alive (contiguous, right dtypes)."""

    values: np.ndarray
    offsets: np.ndarray
    gains: np.ndarray | None
    struct: _FeatureInput


def native_feature(valid: ValidFeature, stack: StackedTable) -> NativeFeature:
    """The C++ view of one validated feature of `stack`."""
    placement = valid.placement
    values = np.ascontiguousarray(valid.values)
    offsets = np.zeros(len(valid.lengths) + 1, dtype=np.int64)
    np.cumsum(valid.lengths, out=offsets[1:])
    gains = None if valid.gains is None else np.ascontiguousarray(valid.gains, dtype=np.float32)
    struct = _FeatureInput(
        values=values.ctypes.data,
        values_are_int64=int(values.dtype == np.int64),
        offsets=offsets.ctypes.data,
        gains=None if gains is None else gains.ctypes.data,
        num_samples=len(valid.lengths),
        samples_per_sparsecore=placement.samples_per_sparsecore,
        sample_offset=placement.sample_offset_in_sparsecore,
        col_shift=placement.col_shift,
        row_offset_in_shard=stack.tables[placement.table_index].row_offset_in_shard,
        max_sequence_length=placement.feature.max_sequence_length if placement.feature.is_sequence else 0,
        vocabulary_size=placement.feature.table.vocabulary_size,
    )
    return NativeFeature(values, offsets, gains, struct)


@dataclass(frozen=True)
class StackCall:
    """The arguments of the C++ calls for one stack and the host's local devices (arrays kept
    alive)."""

    params: _StackParams
    features: ctypes.Array
    buffers: _HostBuffers
    num_devices: int
    keep_alive: tuple[object, ...]


def stack_call(
    stack: StackedTable,
    features: tuple[NativeFeature, ...],
    sizes: BufferSizes,
    buffers: PackedBuffers,
    row_bits: int,
    allow_id_dropping: bool,
) -> StackCall:
    """The C++ view of `buffers` (every local device's; uninitialised: the C++ writes every
    slot) and of the stack's features and parameters."""
    starts = np.array([t.row_offset_in_shard for t in stack.tables] + [1 << row_bits], dtype=np.int64)
    params = _StackParams(
        num_sparsecores=stack.num_sparsecores,
        sparsecores_per_device=sizes.sparsecores_per_device,
        row_bits=row_bits,
        row_pointers_per_sparsecore=sizes.row_pointers_per_sparsecore,
        segment=sizes.coo_buffer_size_per_sparsecore,
        unique_width=sizes.unique_rows_per_partition,
        max_ids=stack.max_ids_per_partition,
        max_unique=stack.max_unique_ids_per_partition,
        allow_dropping=int(allow_id_dropping),
        num_tables=len(stack.tables),
        table_row_starts=starts.ctypes.data,
        pad_id=PAD_ID,
        sample_bits=max(1, (sizes.batch_size_per_sparsecore - 1).bit_length()),
    )
    unique = buffers.unique
    views = _HostBuffers(
        row_pointers=buffers.row_pointers.ctypes.data,
        embedding_ids=buffers.embedding_ids.ctypes.data,
        sample_ids=buffers.sample_ids.ctypes.data,
        gains=buffers.gains.ctypes.data,
        unique_ids=None if unique is None else unique.unique_ids.ctypes.data,
        unique_counts=None if unique is None else unique.unique_counts.ctypes.data,
        entry_unique_index=None if unique is None else unique.entry_unique_index.ctypes.data,
    )
    array = (_FeatureInput * len(features))(*(f.struct for f in features))
    return StackCall(params, array, views, len(buffers.row_pointers), (starts, features, buffers))


def _check(status: int, call: StackCall, stack: StackedTable) -> None:
    where = f"stacked table {stack.name!r}"
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"{where}: host preprocessing ran out of memory")
    if status == SIDE_CAR_OVERFLOW:
        raise RuntimeError(
            f"{where}: more distinct rows in a partition than the side-car's "
            f"{call.params.unique_width} slots (a preprocessing bug)"
        )


def pack(call: StackCall, stack: StackedTable, num_threads: int) -> SparseCoreCounts:
    """Fill the buffers of every local device, the SparseCores on up to `num_threads` threads;
    see the module docstring. Limits and a full buffer are reported in the statuses, not raised."""
    g = call.num_devices * call.params.sparsecores_per_device
    n, t = call.params.num_sparsecores, call.params.num_tables
    buckets = np.empty((3, g, n), dtype=np.int32)
    tables = np.empty((2, g, t), dtype=np.int32)
    dropped = np.empty(g, dtype=np.int64)
    statuses = np.empty(g, dtype=np.int32)
    out = _HostCounts(
        ids_per_bucket=buckets[0].ctypes.data,
        unique_per_bucket=buckets[1].ctypes.data,
        kept_per_bucket=buckets[2].ctypes.data,
        table_ids_max=tables[0].ctypes.data,
        table_unique_max=tables[1].ctypes.data,
        dropped_ids=dropped.ctypes.data,
        statuses=statuses.ctypes.data,
    )
    status = _library().sparsecore_pack(
        ctypes.byref(call.params), call.features, len(call.features), ctypes.byref(call.buffers),
        ctypes.byref(out), call.num_devices, num_threads,
    )
    _check(status, call, stack)
    return SparseCoreCounts(statuses, buckets[0], buckets[1], buckets[2], tables[0], tables[1], dropped)


def side_car(call: StackCall, stack: StackedTable, num_threads: int) -> None:
    """Build every local device's side-car from its written buffers (every SparseCore packed
    without error), the partitions on up to `num_threads` threads."""
    status = _library().sparsecore_side_car(
        ctypes.byref(call.params), ctypes.byref(call.buffers), call.num_devices, num_threads
    )
    _check(status, call, stack)
