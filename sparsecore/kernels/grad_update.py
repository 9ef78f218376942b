"""The stand-in SparseDenseMatmulGradOpWithOptimizerUpdate: backward of the lookup fused with a
per-row optimizer, updating the table and its slots in place.

Per device (inside `shard_map`), for the rows of its S shards:

1. route the entries to their owners (as the lookup does) and gather every device's activation
   gradients;
2. merge the host's per-(source device, partition) unique rows into one list per target
   SparseCore (with one device there is nothing to merge; otherwise rows that several devices
   looked up are merged by a sort), so every touched row has exactly one slot;
3. accumulate each entry's `gain * activation_grad` into its row's slot, once per row;
4. walk the touched rows in chunks: gather row and slots, apply the optimizer body
   (`OptimizerSpec.update_rows`), scatter them back. Rows not touched, and their slots, are not
   read or written, so they stay bit-for-bit unchanged.

The table, the slots and the gradient workspace are donated by the caller; this program has no
gather of the table outside the update loop, which is what keeps XLA from copying the table.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from sparsecore.kernels.geometry import KernelGeometry
from sparsecore.kernels.routing import (
    OwnedEntries,
    gather_activation_grads,
    route_entries,
    route_unique_rows,
)
from sparsecore.kernels.rows import accumulate_rows, gather_rows, scatter_rows, varying
from sparsecore.optimizers import OptimizerSpec
from sparsecore.preprocess import PAD_ID

Array = jax.Array


def workspace_rows(geometry: KernelGeometry) -> int:
    """Rows of the per-device gradient workspace: one per mergeable row, plus a discard row."""
    return geometry.sparsecores_per_device * geometry.merged_rows_per_sparsecore + 1


def merge_unique_rows(unique: Array, geometry: KernelGeometry) -> tuple[Array, Array, Array]:
    """One slot per distinct row the owner received, from the sources' unique lists.

    `unique [G, S, U]`: source device g's ascending rows of target SparseCore t (`PAD_ID` after
    the real ones). Returns `slot_of [G, S, U]` (each list entry's slot in [0, S*M), M =
    `merged_rows_per_sparsecore`), `rows [S*M]` (the owner-local table row of each slot, or
    `rows_per_device` where unused) and `counts [S]` (slots used per target SparseCore).
    """
    g, s, u = unique.shape
    merged = geometry.merged_rows_per_sparsecore
    target = jnp.arange(s, dtype=jnp.int32)[:, None]
    unused = geometry.rows_per_device
    if g == 1:
        keys = unique[0]
        rows = jnp.where(keys != PAD_ID, target * geometry.rows_per_shard + keys, unused)
        slot_of = (target * merged + jnp.arange(u, dtype=jnp.int32))[None]
        return slot_of, rows.reshape(-1), jnp.sum(keys != PAD_ID, axis=1, dtype=jnp.int32)
    keys = unique.swapaxes(0, 1).reshape(s, g * u)
    ordered = jnp.sort(keys, axis=1)
    first = jnp.concatenate([jnp.ones((s, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    first &= ordered != PAD_ID
    rank = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1
    position = jax.vmap(jnp.searchsorted)(ordered, keys)
    slot_of = target * merged + jnp.take_along_axis(rank, position, axis=1)
    destination = jnp.where(first, target * merged + rank, s * merged).reshape(-1)
    values = (target * geometry.rows_per_shard + ordered).reshape(-1)
    rows = jnp.full((s * merged,), unused, jnp.int32).at[destination].set(values, mode="drop")
    return slot_of.reshape(s, g, u).swapaxes(0, 1), rows, jnp.sum(first, axis=1, dtype=jnp.int32)


def accumulate_gradients(
    workspace: Array,
    grads: Array,
    entries: OwnedEntries,
    slot_of: Array,
    geometry: KernelGeometry,
) -> Array:
    """`workspace[slot of entry] += gain * grads[entry's source sample]` over all real entries;
    the workspace must be zero. `grads` is every device's `[G*S*B, D]`."""
    slot_of = slot_of.reshape(-1)
    discard = workspace.shape[0] - 1
    per_source = geometry.sparsecores_per_device * geometry.unique_rows_per_partition

    def read(window: Array, offset: Array) -> tuple[Array, Array, Array]:
        chunk = entries.read(window, offset)
        flat = OwnedEntries.source_device(window, geometry) * per_source + chunk.unique_slots
        slots = jnp.where(chunk.valid, slot_of[jnp.where(chunk.valid, flat, 0)], discard)
        return jnp.where(chunk.valid, chunk.outputs, -1), slots, chunk.gains

    return accumulate_rows(workspace, grads, entries.used, read, geometry.chunk)


def apply_optimizer(
    table: Array,
    slots: Mapping[str, Array],
    workspace: Array,
    rows: Array,
    counts: Array,
    optimizer: OptimizerSpec,
    hyperparameters: Mapping[str, Array],
    geometry: KernelGeometry,
) -> tuple[Array, dict[str, Array]]:
    """Update every slot's row of `table` and `slots` with its accumulated gradient, in chunks of
    `geometry.row_chunk` rows, visiting only the slots in use."""
    chunk, merged = geometry.row_chunk, geometry.merged_rows_per_sparsecore
    ends = jnp.cumsum(counts, dtype=jnp.int32)
    starts = ends - counts
    total = ends[-1]
    discard = workspace.shape[0] - 1
    last_target = geometry.sparsecores_per_device - 1

    def step(index: Array, state: tuple[Array, dict[str, Array]]) -> tuple[Array, dict[str, Array]]:
        table, slots = state
        visit = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        target = jnp.minimum(jnp.sum(visit[:, None] >= ends[None, :], axis=1, dtype=jnp.int32), last_target)
        slot = target * merged + visit - starts[target]
        live = visit < total
        row = jnp.where(live, rows[jnp.where(live, slot, 0)], geometry.rows_per_device)
        grad = gather_rows(workspace, jnp.where(live, slot, discard))
        current = {name: gather_rows(value, row, fill=True) for name, value in slots.items()}
        new_rows, new_slots = optimizer.update_rows(grad, gather_rows(table, row, fill=True), current, hyperparameters)
        table = scatter_rows(table, row, new_rows, add=False, unique=True)
        slots = {name: scatter_rows(slots[name], row, new_slots[name], add=False, unique=True) for name in slots}
        return table, slots

    steps = (total + chunk - 1) // chunk
    return lax.fori_loop(0, steps, step, (table, dict(slots)))


def update_local(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    entry_unique_index: Array,
    unique_ids: Array,
    activation_grads: Array,
    table: Array,
    slots: Mapping[str, Array],
    workspace: Array,
    hyperparameters: Mapping[str, Array],
    *,
    geometry: KernelGeometry,
    optimizer: OptimizerSpec,
    axis_name: str,
) -> tuple[Array, dict[str, Array], Array]:
    """One device's fused backward and optimizer step.

    Buffers and side-car are this device's 1-D / `[N, U]` arrays, `activation_grads [S*B, D]`,
    `table [S*Vs, D]`, each slot `[S*Vs, width]`, `workspace [workspace_rows, D]` (any content;
    it is zeroed first). Returns the updated table, slots and the spent workspace.
    """
    entries = route_entries(
        row_pointers, embedding_ids, sample_ids, gains, entry_unique_index, geometry, axis_name
    )
    slot_of, rows, counts = merge_unique_rows(route_unique_rows(unique_ids, geometry, axis_name), geometry)
    grads = gather_activation_grads(activation_grads, axis_name)
    workspace = varying(jnp.zeros(workspace.shape, workspace.dtype), axis_name)
    workspace = accumulate_gradients(workspace, grads, entries, slot_of, geometry)
    table, slots = apply_optimizer(table, slots, workspace, rows, counts, optimizer, hyperparameters, geometry)
    return table, slots, workspace
