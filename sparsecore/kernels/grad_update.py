"""The stand-in SparseDenseMatmulGradOpWithOptimizerUpdate: backward of the lookup fused with a
per-row optimizer, updating the table and its slots in place.

Per device (inside `shard_map`), for the rows of its S shards:

1. route the entries to their owners (as the lookup does) and gather every device's activation
   gradients;
2. merge the host's per-(source device, partition) unique rows into one list per target
   SparseCore (with one device there is nothing to merge; otherwise rows that several devices
   looked up are merged by a sort), so every touched row has exactly one workspace slot;
3. accumulate each entry's `gain * activation_grad` into its row's slot, once per row;
4. walk the touched rows in chunks: read their slots' gradients (contiguous workspace rows)
   and set those slots back to zero, gather row and optimizer slots, apply the optimizer body
   (`OptimizerSpec.update_rows`, told the tables' own width so a row-wise slot averages over it,
   not the padding), scatter them back. Rows not touched, and their slots, are not read or
   written, so they stay bit-for-bit unchanged.

The table, the slots and the gradient workspace are donated by the caller; this program has no
gather of the table outside the update loop, which is what keeps XLA from copying the table. The
workspace is all zeros between steps: a step writes only the slots its batch uses, and step 4
clears each slot as it reads it, so the next step finds it zeroed without a pass over the whole
of it (31 MB on the mlperf DLRM).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

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
from sparsecore.kernels.rows import accumulate_rows, gather_rows, scatter_rows
from sparsecore.optimizers import OptimizerSpec
from sparsecore.preprocess import PAD_ID

Array = jax.Array


def workspace_rows(geometry: KernelGeometry) -> int:
    """Rows of the per-device gradient workspace: one per mergeable row, plus one optimizer step
    of tail so that every step reads whole rows in bounds."""
    return geometry.sparsecores_per_device * geometry.merged_rows_per_sparsecore + geometry.row_step


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


def entry_slots(entries: OwnedEntries, slot_of: Array, geometry: KernelGeometry) -> Array:
    """The workspace slot of every owned entry `[W, P]` (0 where the slot holds no entry), from
    `slot_of [G, S, U]` (`merge_unique_rows`). On one device the merged lists are the device's
    own, so an entry's slot is its unique-list index."""
    if geometry.num_devices == 1:
        return entries.unique_slots
    per_source = geometry.sparsecores_per_device * geometry.unique_rows_per_partition
    source = OwnedEntries.source_device(jnp.arange(entries.rows.shape[0], dtype=jnp.int32), geometry)
    flat = jnp.where(entries.valid, source[:, None] * per_source + entries.unique_slots, 0)
    return jnp.where(entries.valid, slot_of.reshape(-1)[flat], 0)


def accumulate_gradients(
    workspace: Array,
    grads: Array,
    entries: OwnedEntries,
    slots: Array,
    geometry: KernelGeometry,
) -> Array:
    """`workspace[slot of entry] += gain * grads[entry's source sample]` over all real entries.
    `grads` is every device's `[G*S*B, D]`, `slots` the entries' `entry_slots`."""
    chunk, batch = geometry.chunk, geometry.batch_size_per_sparsecore

    def read(window: Array, offset: Array) -> tuple[Array, Array, Array]:
        rows, samples, gains, slot = (
            lax.dynamic_slice(a, (window, offset), (1, chunk))[0]
            for a in (entries.rows, entries.samples, entries.gains, slots)
        )
        return jnp.where(rows >= 0, window * batch + samples, -1), slot, gains

    return accumulate_rows(workspace, grads, entries.used, read, chunk)


def _target_steps(counts: Array, geometry: KernelGeometry) -> tuple[Array, Callable[[Array], tuple[Array, Array]]]:
    """Steps of `geometry.row_step` workspace slots over each target's `counts` used slots: the
    number of steps, and `step -> (first slot, live mask)`."""
    chunk, merged = geometry.row_step, geometry.merged_rows_per_sparsecore
    per_target = (counts + chunk - 1) // chunk
    ends = jnp.cumsum(per_target, dtype=jnp.int32)
    starts = ends - per_target

    def slots(index: Array) -> tuple[Array, Array]:
        target = jnp.sum(index >= ends, dtype=jnp.int32)
        first = (index - starts[target]) * chunk
        live = first + jnp.arange(chunk, dtype=jnp.int32) < counts[target]
        return target * merged + first, live

    return ends[-1], slots


def apply_optimizer(
    table: Array,
    slots: Mapping[str, Array],
    workspace: Array,
    rows: Array,
    counts: Array,
    optimizer: OptimizerSpec,
    hyperparameters: Mapping[str, Array],
    geometry: KernelGeometry,
) -> tuple[Array, dict[str, Array], Array]:
    """Update every used slot's row of `table` and `slots` with its accumulated gradient, target
    by target in steps of `geometry.row_step` contiguous workspace slots; returns the new table,
    slots and the workspace with every slot read set to zero."""
    chunk = geometry.row_step
    steps, step_slots = _target_steps(counts, geometry)
    rows = jnp.pad(rows, (0, chunk), constant_values=geometry.rows_per_device)

    def step(
        index: Array, state: tuple[Array, dict[str, Array], Array]
    ) -> tuple[Array, dict[str, Array], Array]:
        table, slots, workspace = state
        first, live = step_slots(index)
        row = jnp.where(live, lax.dynamic_slice(rows, (first,), (chunk,)), geometry.rows_per_device)
        slot = first + jnp.arange(chunk, dtype=jnp.int32)
        grad = gather_rows(workspace, slot)
        # Clear only the live slots: a target's last step reads past its count, into the next
        # target's. Writing values computed from `grad` (zeros where live) orders this in-place
        # write after the read; without that, XLA copies the whole workspace every step.
        workspace = scatter_rows(
            workspace, jnp.where(live, slot, workspace.shape[0]), jnp.where(live[:, None], 0.0, grad), add=False,
            unique=True,
        )
        current = {name: gather_rows(value, row, fill=True) for name, value in slots.items()}
        new_rows, new_slots = optimizer.update_rows(
            grad, gather_rows(table, row, fill=True), current, hyperparameters, dim=geometry.logical_embedding_dim
        )
        table = scatter_rows(table, row, new_rows, add=False, unique=True)
        slots = {name: scatter_rows(slots[name], row, new_slots[name], add=False, unique=True) for name in slots}
        return table, slots, workspace

    return lax.fori_loop(0, steps, step, (table, dict(slots), workspace))


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
    `table [S*Vs, D]`, each slot `[S*Vs, width]`, `workspace [workspace_rows, D]` (all zeros, as
    the previous step left it). Returns the updated table, slots and the workspace, all zeros
    again.
    """
    entries = route_entries(
        row_pointers, embedding_ids, sample_ids, gains, entry_unique_index, geometry, axis_name
    )
    slot_of, rows, counts = merge_unique_rows(route_unique_rows(unique_ids, geometry, axis_name), geometry)
    grads = gather_activation_grads(activation_grads, geometry, axis_name)
    workspace = accumulate_gradients(workspace, grads, entries, entry_slots(entries, slot_of, geometry), geometry)
    return apply_optimizer(table, slots, workspace, rows, counts, optimizer, hyperparameters, geometry)
