"""The stand-in SparseDenseMatmul: per-sample weighted sums of table rows, on a device mesh.

Per device (inside `shard_map`): route the buffers' entries to the owners of their partitions,
let every owner add `gain * table[row]` into the partial activation of the entry's source sample,
and send the partials back, where the source sums them into `[S*B, D]`. Combiners need no code
here: the host folded mean and sqrtn into the gains.

XLA:CPU cost model behind the shape of the loop (see `notes/xla-cpu-embedding-performance.md`):
a gather of all entries' rows into one `[entries, D]` buffer page-faults a fresh allocation every
step and dominates the time, so the owner walks the entries in chunks that stay in cache and
scatter-adds each chunk into the activations. The table is only read here, so this program never
shares a computation with the in-place update of the same table.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsecore.kernels.geometry import KernelGeometry
from sparsecore.kernels.routing import OwnedEntries, return_activations, route_entries
from sparsecore.kernels.rows import accumulate_rows, varying

Array = jax.Array


def pooled_partials(table: Array, entries: OwnedEntries, geometry: KernelGeometry, axis_name: str) -> Array:
    """Owner side: partial activations `[G*S*B, D]` of every source sample from this device's
    shards."""
    zeros = jnp.zeros((geometry.num_devices * geometry.samples_per_device, table.shape[1]), table.dtype)

    def read(window: Array, offset: Array) -> tuple[Array, Array, Array]:
        entries_chunk = entries.read(window, offset)
        return entries_chunk.rows, entries_chunk.outputs, entries_chunk.gains

    return accumulate_rows(varying(zeros, axis_name), table, entries.used, read, geometry.chunk)


def lookup_local(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    table: Array,
    *,
    geometry: KernelGeometry,
    axis_name: str,
) -> Array:
    """One device's lookup: its 1-D buffers and table shard `[S*Vs, D]` -> activations `[S*B, D]`."""
    entries = route_entries(row_pointers, embedding_ids, sample_ids, gains, None, geometry, axis_name)
    partials = pooled_partials(table, entries, geometry, axis_name)
    return return_activations(partials, geometry, axis_name)
