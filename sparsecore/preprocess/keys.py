"""The integer sort key of every id, and the radix sort that orders them.

Host preprocessing sorts ids by where they go. The key packs, as bit fields (N and S are powers
of two and the row field is rows_per_shard rounded up to one, so every field is a shift):

* device-major (with the unique-row side-car): local device | partition | embedding id |
  SparseCore. Ids of one (device, partition, row) are adjacent -- the side-car's groups -- and
  the buffer order needs one more pass by (SparseCore, partition);
* SparseCore-major (without it): local device | SparseCore | partition | embedding id, which is
  the buffer order itself.

Within equal keys a stable sort keeps input order, i.e. ascending sample order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sparsecore.layout import StackedTable
from sparsecore.topology import Topology

__all__ = ["KeyLayout", "stable_argsort"]


def stable_argsort(keys: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of non-negative integer keys below `bound`.

    Least-significant-digit radix sort: NumPy sorts 8- and 16-bit keys stably in linear time,
    several times faster than its comparison sort of int32/int64 keys. Digits are 16 bits, the
    last one 8 when that covers what is left.
    """
    order: np.ndarray | None = None
    shift = 0
    while True:
        digits = keys if order is None else keys[order]
        if shift:
            digits = digits >> shift
        highest_digit = (bound - 1) >> shift
        dtype = np.uint8 if highest_digit < 1 << 8 else np.uint16
        digit_order = np.argsort((digits & 0xFFFF).astype(dtype), kind="stable")
        order = digit_order if order is None else order[digit_order]
        shift += 16
        if bound <= 1 << shift:
            return order


@dataclass(frozen=True)
class KeyLayout:
    """Bit fields of the sort key of one stack's ids on `sparsecores` consecutive local
    SparseCores (whole devices in the device-major layout; see module docstring)."""

    sparsecores: int
    num_sparsecores: int
    rows_per_shard: int
    sparsecores_per_device: int
    sparsecore_major: bool

    @classmethod
    def for_stack(
        cls, stack: StackedTable, topology: Topology, sparsecore_major: bool
    ) -> KeyLayout:
        """The layout of all of this host's SparseCores."""
        return cls(
            topology.local_sparsecores,
            topology.num_sparsecores,
            stack.rows_per_shard,
            topology.sparsecores_per_device,
            sparsecore_major,
        )

    def chunk(self, first: int, end: int) -> KeyLayout:
        """The layout of local SparseCores [first, end), whose keys are this layout's keys
        minus `base(first)`."""
        if not self.sparsecore_major and (first | end) % self.sparsecores_per_device:
            raise ValueError(f"device-major key chunks must be whole devices, got [{first}, {end})")
        return dataclasses.replace(self, sparsecores=end - first)

    def base(self, first: int) -> int:
        """Key of the first id of local SparseCore `first` (partition 0, row 0)."""
        if self.sparsecore_major:
            return first << (self.partition_bits + self.row_bits)
        device = first // self.sparsecores_per_device
        return device << (self.partition_bits + self.row_bits + self.sc_bits)

    @property
    def buckets(self) -> int:
        """(SparseCore, partition) pairs covered: the partitions of the buffers."""
        return self.sparsecores * self.num_sparsecores

    @property
    def sc_bits(self) -> int:
        return self.sparsecores_per_device.bit_length() - 1

    @property
    def row_bits(self) -> int:
        return (self.rows_per_shard - 1).bit_length()

    @property
    def partition_bits(self) -> int:
        return self.num_sparsecores.bit_length() - 1

    @property
    def bound(self) -> int:
        """One past the largest key."""
        return self.sparsecores << (self.partition_bits + self.row_bits)

    @property
    def in_buffer_order(self) -> bool:
        """Whether key order is already the buffers' (SparseCore, partition, row) order."""
        return self.sparsecore_major or self.sparsecores_per_device == 1

    @property
    def dtype(self) -> type[np.signedinteger]:
        """int32 when every key (and so every id of the stack) fits, else int64: half the
        memory traffic for the common case."""
        return np.int32 if self.bound <= 2**31 else np.int64

    def sample_part(self, local_sparsecore: np.ndarray) -> np.ndarray:
        """Key bits set by where a sample goes: its device and SparseCore."""
        local_sparsecore = local_sparsecore.astype(self.dtype)
        if self.sparsecore_major:
            return local_sparsecore << (self.partition_bits + self.row_bits)
        device = local_sparsecore >> self.sc_bits
        shift = self.partition_bits + self.row_bits + self.sc_bits
        return (device << shift) | (local_sparsecore & (self.sparsecores_per_device - 1))

    def id_part(self, partition: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Key bits set by the id: its partition and row in the partition's shard."""
        column = (partition << self.row_bits) | row
        return column if self.sparsecore_major else column << self.sc_bits

    def bucket(self, keys: np.ndarray) -> np.ndarray:
        """local SparseCore * N + partition."""
        if self.sparsecore_major:
            return keys >> self.row_bits
        device_partition = self.device_partition(self.row_key(keys))
        device = device_partition >> self.partition_bits
        local_sparsecore = (device << self.sc_bits) | (keys & (self.sparsecores_per_device - 1))
        return (local_sparsecore << self.partition_bits) | (
            device_partition & (self.num_sparsecores - 1)
        )

    def row(self, keys: np.ndarray) -> np.ndarray:
        """The embedding id: row in the partition's shard."""
        if not self.sparsecore_major:
            keys = keys >> self.sc_bits
        return keys & ((1 << self.row_bits) - 1)

    def row_key(self, keys: np.ndarray) -> np.ndarray:
        """Device-major layout only: the key without its SparseCore field, one value per
        (device, partition, row) -- a row that a device looks up in a partition."""
        return keys >> self.sc_bits

    def device_partition(self, row_keys: np.ndarray) -> np.ndarray:
        """device * N + partition of row keys (`row_key`)."""
        return row_keys >> self.row_bits

    def row_of_row_key(self, row_keys: np.ndarray) -> np.ndarray:
        return row_keys & ((1 << self.row_bits) - 1)
