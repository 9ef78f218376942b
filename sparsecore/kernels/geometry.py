"""Static sizes of one stacked table's kernels: everything that fixes a compiled program's shapes.

The kernels read the packed buffers exactly as the host preprocessing writes them (see
`sparsecore.preprocess.pack`); this module only names their sizes and the few index maps the
kernels need. Per device: `row_pointers [S*R]`, `embedding_ids`, `sample_ids`, `gains [C]`, the
stand-in side-car (`entry_unique_index [C]`, `unique_ids [N, U]`, `unique_counts [N]`), the
table shard `[S*Vs, D]`, activations `[S*B, D]` (B samples per SparseCore, SparseCore-major),
of which each feature's are a block (`FeatureBlock`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from sparsecore.layout import StackedTable, round_up
from sparsecore.preprocess import BufferSizes
from sparsecore.topology import Topology

ENTRY_CHUNK_BYTES = 512 * 1024
"""Bytes of gathered float32 rows per step of the accumulate loops (`chunk_rows` turns it into
entries for a dim): big enough to amortise a loop step, small enough that the `[chunk, D]`
temporaries stay in a core's L2 cache between the gather that writes them and the scatter that
reads them. Measured on the stand-in host (2 cores, 512 KiB L2 each, loaded by other processes):
the benchmark's lookup ran 1.8-2.6x and its update 1.2-2.1x faster with 512 KiB chunks than with
the 2-4 MiB of 8192 entries, at dim 64 and 128."""

ROW_CHUNK_BYTES = 256 * 1024
"""Bytes of float32 rows per step of the optimizer loop, which holds several `[row_step, D]`
temporaries at once (gradient, row, new row)."""

MAX_CHUNK = 8192
"""Most entries (rows) per loop step whatever the dim: each also carries int32 indices and gains."""


def chunk_rows(embedding_dim: int, budget: int) -> int:
    """Rows of `embedding_dim` float32 values that fit `budget` bytes, at most `MAX_CHUNK`: a
    multiple of 8, at least 8."""
    return max(8, min(MAX_CHUNK, budget // (4 * embedding_dim)) // 8 * 8)


class FeatureBlock(NamedTuple):
    """One feature's activations in a stack's: samples [sample_offset, sample_offset + samples)
    of every SparseCore's batch (its placement's), their first `dim` columns (its table's dim)."""

    sample_offset: int
    samples: int
    dim: int


DEFAULT_LANES = 2
"""Independent accumulation loops of the lookup, each over its own windows into its own output
block: XLA:CPU runs independent operations concurrently, one loop per core of the stand-in host."""


@dataclasses.dataclass(frozen=True)
class KernelGeometry:
    """Shapes of one stacked table on a mesh of `num_devices` devices.

    `embedding_dim` is the stack's padded width, `logical_embedding_dim` the columns of its
    widest table's own rows (what a row-wise optimizer slot averages over).
    `max_ids_per_partition` / `max_unique_ids_per_partition` bound the entries / distinct rows
    one SparseCore sends to one partition (the host enforces them), `unique_rows_per_partition`
    (U) the side-car's distinct rows per (device, partition). `entry_chunk`, `row_chunk` and
    `lanes` (a power of two) tile the stand-in's loops; they do not change what is computed
    (`for_stack` sizes the chunks by bytes: `ENTRY_CHUNK_BYTES`, `ROW_CHUNK_BYTES`).
    `features` are the stack's features' blocks of the activations, in the stack's order.
    """

    name: str
    num_devices: int
    sparsecores_per_device: int
    row_pointers_per_sparsecore: int
    coo_buffer_size: int
    batch_size_per_sparsecore: int
    rows_per_shard: int
    embedding_dim: int
    logical_embedding_dim: int
    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    unique_rows_per_partition: int
    entry_chunk: int
    row_chunk: int
    features: tuple[FeatureBlock, ...]
    lanes: int = DEFAULT_LANES

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in ("name", "features") and not (isinstance(value, int) and value > 0):
                raise ValueError(f"KernelGeometry {self.name!r}: {field.name} must be a positive int, got {value!r}")
        if self.coo_buffer_size % (8 * self.sparsecores_per_device):
            raise ValueError(
                f"KernelGeometry {self.name!r}: coo_buffer_size {self.coo_buffer_size} is not a "
                f"multiple of 8 x {self.sparsecores_per_device} SparseCores"
            )
        if self.logical_embedding_dim > self.embedding_dim:
            raise ValueError(
                f"KernelGeometry {self.name!r}: logical_embedding_dim {self.logical_embedding_dim} is wider "
                f"than the {self.embedding_dim} columns of the rows"
            )
        if self.lanes & (self.lanes - 1):
            raise ValueError(f"KernelGeometry {self.name!r}: lanes must be a power of two, got {self.lanes}")
        if self.row_pointers_per_sparsecore < self.num_sparsecores:
            raise ValueError(
                f"KernelGeometry {self.name!r}: {self.row_pointers_per_sparsecore} row pointers per "
                f"SparseCore cannot hold {self.num_sparsecores} partitions"
            )
        blocks, batch = self.features, self.batch_size_per_sparsecore
        in_order = all(b.sample_offset >= a.sample_offset + a.samples for a, b in zip(blocks, blocks[1:]))
        inside = all(
            0 <= b.sample_offset and 0 < b.samples <= batch - b.sample_offset and 0 < b.dim <= self.embedding_dim
            for b in blocks
        )
        if not (in_order and inside):
            raise ValueError(
                f"KernelGeometry {self.name!r}: feature blocks {blocks} are not non-empty, in order and "
                f"disjoint within the batch of {batch} samples and the {self.embedding_dim} columns"
            )

    @classmethod
    def for_stack(
        cls, stack: StackedTable, topology: Topology, sizes: BufferSizes, **tiling: int
    ) -> KernelGeometry:
        """The geometry of `stack` on `topology` with the host's buffer sizes; `tiling` overrides
        `entry_chunk`, `row_chunk` (sized by bytes for the stack's dim by default) or `lanes`."""
        if stack.num_sparsecores != topology.num_sparsecores:
            raise ValueError(
                f"stack {stack.name!r} is laid out for {stack.num_sparsecores} SparseCores, the "
                f"topology has {topology.num_sparsecores}"
            )
        return cls(
            name=stack.name,
            num_devices=topology.global_device_count,
            sparsecores_per_device=topology.sparsecores_per_device,
            row_pointers_per_sparsecore=sizes.row_pointers_per_sparsecore,
            coo_buffer_size=sizes.coo_buffer_size_per_device,
            batch_size_per_sparsecore=sizes.batch_size_per_sparsecore,
            rows_per_shard=stack.rows_per_shard,
            embedding_dim=stack.embedding_dim,
            logical_embedding_dim=stack.logical_embedding_dim,
            max_ids_per_partition=stack.max_ids_per_partition,
            max_unique_ids_per_partition=stack.max_unique_ids_per_partition,
            unique_rows_per_partition=sizes.unique_rows_per_partition,
            features=tuple(
                FeatureBlock(p.sample_offset_in_sparsecore, p.samples_per_sparsecore, p.feature.table.embedding_dim)
                for p in stack.features
            ),
            **{
                "entry_chunk": chunk_rows(stack.embedding_dim, ENTRY_CHUNK_BYTES),
                "row_chunk": chunk_rows(stack.embedding_dim, ROW_CHUNK_BYTES),
                **tiling,
            },
        )

    @property
    def num_sparsecores(self) -> int:
        """N: partitions (MOD shards) of the stack."""
        return self.num_devices * self.sparsecores_per_device

    @property
    def segment_size(self) -> int:
        """COO slots owned by one SparseCore (C / S)."""
        return self.coo_buffer_size // self.sparsecores_per_device

    @property
    def window(self) -> int:
        """Slots one SparseCore sends to one device: its S partitions there, each at most
        round8(max ids) long, never more than the whole segment."""
        per_partition = round_up(self.max_ids_per_partition, 8)
        return min(self.sparsecores_per_device * per_partition, self.segment_size)

    @property
    def chunk(self) -> int:
        """Entries per step of the accumulate loops: at most `entry_chunk`, a multiple of 8,
        chosen so that whole chunks tile a window with the least padding."""
        steps = -(-self.window // self.entry_chunk)
        return round_up(-(-self.window // steps), 8)

    @property
    def padded_window(self) -> int:
        """`window` rounded up to whole chunks (the tail slots are invalid)."""
        return round_up(self.window, self.chunk)

    @property
    def rows_per_device(self) -> int:
        """Rows of the table (and of every slot) one device holds: its S shards."""
        return self.sparsecores_per_device * self.rows_per_shard

    @property
    def samples_per_device(self) -> int:
        return self.sparsecores_per_device * self.batch_size_per_sparsecore

    @property
    def row_step(self) -> int:
        """Workspace slots per step of the optimizer loop: `row_chunk`, at most one target's."""
        return min(self.row_chunk, self.merged_rows_per_sparsecore)

    @property
    def merged_rows_per_sparsecore(self) -> int:
        """Capacity for the distinct rows one target SparseCore receives from all devices."""
        return self.num_devices * self.unique_rows_per_partition
