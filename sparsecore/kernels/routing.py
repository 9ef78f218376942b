"""Collectives of the stand-in kernels: entries to the device owning their SparseCore, and back.

Runs per device inside `shard_map` over a 1-D mesh (axis `axis_name`, one position per device).
Each local SparseCore s sends, to every device e, the *window* of its segment that holds
partitions e*S .. e*S+S-1 (contiguous in the buffer, at most `geometry.window` slots). Slots are
masked by the row pointers before they leave: gaps, pads and the undefined tail after the last
partition never reach an owner. One `all_to_all` moves (row, unique slot, sample, gain) per slot;
the owner then knows, for every entry, which local table row it reads and which source sample it
feeds. Activations go back with a second `all_to_all`; activation gradients reach every owner
with an `all_gather`.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sparsecore.kernels.geometry import KernelGeometry

Array = jax.Array


class OwnedEntries(NamedTuple):
    """The entries one device received for its S shards, flat over [source device, source
    SparseCore, window slot]. Invalid slots have `rows == -1` and `gains == 0`."""

    rows: Array
    unique_slots: Array
    outputs: Array
    gains: Array

    @property
    def valid(self) -> Array:
        return self.rows >= 0


def _window_slots(row_pointers: Array, geometry: KernelGeometry) -> tuple[Array, Array, Array]:
    """Per (local SparseCore, destination device, window slot): position in the SparseCore's
    segment, whether it holds a real entry, and its target SparseCore on the destination."""
    g, s, n = geometry.num_devices, geometry.sparsecores_per_device, geometry.num_sparsecores
    ends = row_pointers.reshape(s, geometry.row_pointers_per_sparsecore)[:, :n]
    rounded = (ends + 7) // 8 * 8
    starts = jnp.concatenate([jnp.zeros((s, 1), ends.dtype), rounded[:, :-1]], axis=1)
    starts, ends = starts.reshape(s, g, 1, s), ends.reshape(s, g, 1, s)
    position = starts[..., 0] + jnp.arange(geometry.window, dtype=ends.dtype)
    inside = (position[..., None] >= starts) & (position[..., None] < ends)
    return position, inside.any(axis=-1), jnp.argmax(inside, axis=-1).astype(jnp.int32)


def route_entries(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    entry_unique_index: Array | None,
    geometry: KernelGeometry,
    axis_name: str,
) -> OwnedEntries:
    """Send every real entry of this device's buffers to the device that owns its partition.

    Inputs are this device's 1-D buffers; `entry_unique_index` is the host side-car (or None when
    only a lookup is needed). Returns the entries this device owns, source-major.
    """
    g, s = geometry.num_devices, geometry.sparsecores_per_device
    position, valid, target = _window_slots(row_pointers, geometry)
    sparsecore = jnp.arange(s, dtype=jnp.int32).reshape(s, 1, 1)
    index = jnp.minimum(sparsecore * geometry.segment_size + position, geometry.coo_buffer_size - 1)
    rows = jnp.where(valid, target * geometry.rows_per_shard + embedding_ids[index], -1)
    fields = [rows, jnp.where(valid, sample_ids[index], 0)]
    fields.append(lax.bitcast_convert_type(jnp.where(valid, gains[index], 0.0), jnp.int32))
    if entry_unique_index is not None:
        destination = jnp.arange(g, dtype=jnp.int32).reshape(1, g, 1)
        first_partition = destination * s * geometry.unique_rows_per_partition
        fields.append(jnp.where(valid, entry_unique_index[index] - first_partition, 0))
    payload = jnp.stack(fields, axis=-1).swapaxes(0, 1)
    payload = lax.all_to_all(payload, axis_name, split_axis=0, concat_axis=0)
    source = jnp.arange(g * s, dtype=jnp.int32).reshape(g, s, 1) * geometry.batch_size_per_sparsecore
    rows = payload[..., 0]
    outputs = jnp.where(rows >= 0, source + payload[..., 1], 0)
    gains = lax.bitcast_convert_type(payload[..., 2], jnp.float32)
    unique_slots = payload[..., 3] if entry_unique_index is not None else jnp.zeros_like(rows)
    return OwnedEntries(rows.reshape(-1), unique_slots.reshape(-1), outputs.reshape(-1), gains.reshape(-1))


def route_unique_rows(unique_ids: Array, geometry: KernelGeometry, axis_name: str) -> Array:
    """Send each device's side-car lists `[N, U]` to the partitions' owners: `[G source, S, U]`
    (ascending rows per list, `PAD_ID` after the real ones)."""
    g, s = geometry.num_devices, geometry.sparsecores_per_device
    lists = unique_ids.reshape(g, s, geometry.unique_rows_per_partition)
    return lax.all_to_all(lists, axis_name, split_axis=0, concat_axis=0)


def return_activations(partials: Array, geometry: KernelGeometry, axis_name: str) -> Array:
    """Owner partial sums `[G*S*B, D]` (source-major) -> this device's activations `[S*B, D]`."""
    g = geometry.num_devices
    partials = partials.reshape(g, geometry.samples_per_device, partials.shape[-1])
    return lax.all_to_all(partials, axis_name, split_axis=0, concat_axis=0).sum(axis=0)


def gather_activation_grads(grads: Array, axis_name: str) -> Array:
    """Every device's activation gradients `[S*B, D]` -> `[G*S*B, D]` on every owner."""
    return lax.all_gather(grads, axis_name, tiled=True)
