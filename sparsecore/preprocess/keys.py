"""The integer sort key of every id, and the sort that orders them.

Host preprocessing sorts ids by where they go in the buffers. The key packs, as bit fields (N is a
power of two and the row field is rows_per_shard rounded up to one, so every field is a shift):
local SparseCore | partition | embedding id -- the buffers' order (SparseCore segment, partition,
embedding id). Within equal keys the sort keeps input order, i.e. ascending sample order. A chunk
of consecutive local SparseCores has keys relative to its first one (`KeyLayout.chunk`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sparsecore.layout import StackedTable
from sparsecore.topology import Topology

__all__ = ["KeyLayout", "sorted_order", "stable_argsort"]


def sorted_order(keys: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """The stable order of non-negative integer keys below `bound`, and the keys in that order.

    Each key is packed above its position into one int64 -- distinct values, so any sort is
    stable -- and NumPy's vectorised sort orders them: several times faster than an argsort, and
    the sorted keys come out with the order. Keys too wide to share 63 bits with the positions
    are sorted least-significant digit first, one such pass per digit.
    """
    count = len(keys)
    position_bits = max(1, (count - 1).bit_length())
    digit_bits = 63 - position_bits
    key_bits = max(1, (bound - 1).bit_length())
    positions = np.arange(count, dtype=np.int64)
    order = None
    shifts = range(0, key_bits, digit_bits)
    for shift in shifts:
        packed = (keys if order is None else keys[order]).astype(np.int64)
        if shift:
            packed >>= shift
        if shift != shifts[-1]:
            packed &= (1 << digit_bits) - 1
        packed <<= position_bits
        packed |= positions
        packed.sort()
        digit_order = packed & ((1 << position_bits) - 1)
        order = digit_order if order is None else order[digit_order]
    if len(shifts) > 1:
        return order, keys[order]
    packed >>= position_bits
    return order, packed.astype(keys.dtype, copy=False)


def stable_argsort(keys: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of non-negative integer keys below `bound` (see `sorted_order`)."""
    return sorted_order(keys, bound)[0]


@dataclass(frozen=True)
class KeyLayout:
    """Bit fields of the sort key of one stack's ids on `sparsecores` consecutive local
    SparseCores (see module docstring)."""

    sparsecores: int
    num_sparsecores: int
    rows_per_shard: int

    @classmethod
    def for_stack(cls, stack: StackedTable, topology: Topology) -> KeyLayout:
        """The layout of all of this host's SparseCores."""
        return cls(topology.local_sparsecores, topology.num_sparsecores, stack.rows_per_shard)

    def chunk(self, first: int, end: int) -> KeyLayout:
        """The layout of local SparseCores [first, end), whose keys are this layout's keys
        minus `base(first)`."""
        return dataclasses.replace(self, sparsecores=end - first)

    def base(self, first: int) -> int:
        """Key of the first id of local SparseCore `first` (partition 0, row 0)."""
        return first << self.column_bits

    @property
    def buckets(self) -> int:
        """(SparseCore, partition) pairs covered: the partitions of the buffers."""
        return self.sparsecores * self.num_sparsecores

    @property
    def row_bits(self) -> int:
        return (self.rows_per_shard - 1).bit_length()

    @property
    def partition_bits(self) -> int:
        return self.num_sparsecores.bit_length() - 1

    @property
    def column_bits(self) -> int:
        """Bits of a column: partition and row."""
        return self.partition_bits + self.row_bits

    @property
    def bound(self) -> int:
        """One past the largest key."""
        return self.sparsecores << self.column_bits

    @property
    def dtype(self) -> type[np.signedinteger]:
        """int32 when every key (and so every id of the stack) fits, else int64: half the
        memory traffic for the common case."""
        return np.int32 if self.bound <= 2**31 else np.int64

    def sparsecore_part(self, local_sparsecore: np.ndarray) -> np.ndarray:
        """Key bits set by where a sample goes: its local SparseCore."""
        return local_sparsecore.astype(self.dtype) << self.column_bits

    def id_part(self, partition: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Key bits set by the id: its partition and row in the partition's shard."""
        return (partition << self.row_bits) | row

    def bucket_key(self, bucket: np.ndarray | int) -> np.ndarray | int:
        """The smallest key of bucket (SparseCore * N + partition) `bucket`."""
        return bucket << self.row_bits

    def bucket(self, keys: np.ndarray) -> np.ndarray:
        """local SparseCore * N + partition."""
        return keys >> self.row_bits

    def row(self, keys: np.ndarray) -> np.ndarray:
        """The embedding id: row in the partition's shard."""
        return keys & ((1 << self.row_bits) - 1)

    def column(self, keys: np.ndarray) -> np.ndarray:
        """The key without its SparseCore: partition and row, one value per row a SparseCore
        looks up in a partition."""
        return keys & ((1 << self.column_bits) - 1)
