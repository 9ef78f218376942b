"""The stand-in SparseDenseMatmul: per-sample weighted sums of table rows, on a device mesh.

The lookup of every platform without a kernel of its own, and `lookup_impl="xla"`'s; on the CPU
stand-in the owner's loop below is by default the C++ custom call of `sparsecore.kernels.cpu`.

Per device (inside `shard_map`): route the buffers' entries to the owners of their partitions,
let every owner add `gain * table[row]` into the partial activation of the entry's source sample,
and send the partials back, where the source sums them into `[S*B, D]`. Combiners need no code
here: the host folded mean and sqrtn into the gains.

XLA:CPU cost model behind the shape of the loop (see `notes/xla-cpu-embedding-performance.md`):
a gather of all entries' rows into one `[entries, D]` buffer page-faults a fresh allocation every
step and dominates the time, so the owner walks the entries in chunks that stay in cache and
scatter-adds each chunk into the activations. A window's entries only reach its own source
samples, so the windows are split over `geometry.lanes` independent loops, each into its own
output block, which XLA runs concurrently. The table is only read here, so this program never
shares a computation with the in-place update of the same table.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sparsecore.kernels.geometry import KernelGeometry
from sparsecore.kernels.routing import OwnedEntries, routed_lookup
from sparsecore.kernels.rows import accumulate_rows, varying

Array = jax.Array


def pooled_partials(table: Array, entries: OwnedEntries, geometry: KernelGeometry, axis_name: str) -> Array:
    """Owner side: partial activations `[W*B, D]` of every source sample (window w's B samples
    at rows [w*B, (w+1)*B)) from this device's shards."""
    windows, batch, chunk = entries.rows.shape[0], geometry.batch_size_per_sparsecore, geometry.chunk
    lanes = min(geometry.lanes, windows)
    blocks = []
    for lane in range(lanes):
        mine = windows // lanes  # windows lane, lane + lanes, ... in this lane's block

        def read(position: Array, offset: Array, lane: int = lane) -> tuple[Array, Array, Array]:
            window = lane + position * lanes
            rows, samples, gains = (
                lax.dynamic_slice(a, (window, offset), (1, chunk))[0]
                for a in (entries.rows, entries.samples, entries.gains)
            )
            return rows, position * batch + samples, gains

        zeros = varying(jnp.zeros((mine * batch, table.shape[1]), table.dtype), axis_name)
        block = accumulate_rows(zeros, table, entries.used[lane::lanes], read, chunk)
        blocks.append(block.reshape(mine, batch, -1))
    # Lane l's block k holds window l + k * lanes.
    return jnp.stack(blocks, axis=1).reshape(windows * batch, -1)


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
    return routed_lookup(
        lambda entries: pooled_partials(table, entries, geometry, axis_name),
        row_pointers, embedding_ids, sample_ids, gains, geometry, axis_name,
    )


def feature_activations(activations: Array, geometry: KernelGeometry) -> tuple[Array, ...]:
    """One device's activations `[S*B, D]` -> each feature's `[S * samples, dim]`: its block of
    every local SparseCore's batch (`geometry.features`), SparseCore-major."""
    per_sparsecore = activations.reshape(geometry.sparsecores_per_device, geometry.batch_size_per_sparsecore, -1)
    return tuple(
        per_sparsecore[:, block.sample_offset : block.sample_offset + block.samples, : block.dim].reshape(-1, block.dim)
        for block in geometry.features
    )
