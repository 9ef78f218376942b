"""Observed per-partition maxima of a batch, and the limit update they feed (FDO).

The limits of a stack fix its buffer sizes at compile time. Preprocessing reports what each
batch needed; `update_limits` turns (possibly merged) stats into new limits, observed x margin,
for the next compile. A margin of 1.0 sets the limits to the observed maxima exactly, which is
what jax-tpu-embedding's `update_preprocessing_parameters` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from sparsecore.layout import StackedTable, round_up

__all__ = ["PartitionStats", "update_limits"]


@dataclass(frozen=True)
class PartitionStats:
    """What one batch of one stack needed on this host, before any id was dropped.

    `max_ids_per_partition[d, p]` / `max_unique_ids_per_partition[d, p]`: over local device d's
    SparseCores, the most (sample, column) pairs / distinct columns sent to partition p.
    `required_buffer_size_per_sparsecore[d, s]`: COO slots SparseCore s of device d needed
    (sum over partitions of the pair count rounded up to 8). `table_max_*` hold the same maxima
    per table of the stack (over all devices, SparseCores and partitions). `id_drop_count` counts
    raw ids dropped (limits or a full buffer; only possible with dropping allowed).
    """

    max_ids_per_partition: np.ndarray
    max_unique_ids_per_partition: np.ndarray
    required_buffer_size_per_sparsecore: np.ndarray
    id_drop_count: int
    table_max_ids_per_partition: Mapping[str, int]
    table_max_unique_ids_per_partition: Mapping[str, int]

    @property
    def required_buffer_size_per_device(self) -> int:
        per_sc = self.required_buffer_size_per_sparsecore
        return int(per_sc.max(initial=0)) * per_sc.shape[1]

    def merge(self, other: PartitionStats) -> PartitionStats:
        """Element-wise maxima (and summed drops) of two batches or two hosts' stats."""
        tables = self.table_max_ids_per_partition
        unique = self.table_max_unique_ids_per_partition
        return PartitionStats(
            max_ids_per_partition=np.maximum(
                self.max_ids_per_partition, other.max_ids_per_partition
            ),
            max_unique_ids_per_partition=np.maximum(
                self.max_unique_ids_per_partition, other.max_unique_ids_per_partition
            ),
            required_buffer_size_per_sparsecore=np.maximum(
                self.required_buffer_size_per_sparsecore, other.required_buffer_size_per_sparsecore
            ),
            id_drop_count=self.id_drop_count + other.id_drop_count,
            table_max_ids_per_partition={
                t: max(v, other.table_max_ids_per_partition[t]) for t, v in tables.items()
            },
            table_max_unique_ids_per_partition={
                t: max(v, other.table_max_unique_ids_per_partition[t]) for t, v in unique.items()
            },
        )


def _scaled(observed: int, margin: float) -> int:
    return max(1, math.ceil(observed * margin))


def update_limits(stack: StackedTable, stats: PartitionStats, margin: float = 1.0) -> StackedTable:
    """New limits for `stack`: each observed maximum x `margin` (rounded up, at least 1).

    Updates the stack's max ids / max unique ids, each table's own limits, and the suggested COO
    buffer size (largest per-SparseCore requirement x margin, rounded up to 8, x SparseCores per
    device). Merge the stats of several batches or hosts first (`PartitionStats.merge`) so
    every host compiles with the same limits.
    """
    if not margin >= 1.0:
        raise ValueError(
            f"update_limits: margin must be >= 1.0 (no headroom below observed), got {margin}"
        )
    per_sc = stats.required_buffer_size_per_sparsecore
    sparsecores_per_device = per_sc.shape[1]
    buffer_per_sc = round_up(_scaled(int(per_sc.max(initial=0)), margin), 8)
    table_limits = {
        name: (
            _scaled(stats.table_max_ids_per_partition[name], margin),
            _scaled(stats.table_max_unique_ids_per_partition[name], margin),
        )
        for name in stack.table_names
    }
    max_ids = int(stats.max_ids_per_partition.max(initial=0))
    max_unique = int(stats.max_unique_ids_per_partition.max(initial=0))
    return stack.with_limits(
        max_ids_per_partition=_scaled(max_ids, margin),
        max_unique_ids_per_partition=_scaled(max_unique, margin),
        suggested_coo_buffer_size_per_device=buffer_per_sc * sparsecores_per_device,
        table_limits=table_limits,
    )
