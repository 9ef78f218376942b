"""How entries reach the device that owns their SparseCore (and activations come back).

Runs per device inside `shard_map` over a 1-D mesh (axis `axis_name`, one position per device).
Each local SparseCore s sends, to every device e, the *window* of its segment that holds
partitions e*S .. e*S+S-1 (contiguous in the buffer, at most `geometry.window` slots). Slots are
masked by the row pointers before they leave: gaps, pads and the undefined tail after the last
partition never reach an owner. One `all_to_all` moves (row, sample, gain, unique slot) per slot,
a second the windows' used lengths. With a single device nothing moves: the owner reads its own
segments, masked the same way. Either way the owner gets its entries once, as flat per-window
arrays (`OwnedEntries`) that the kernels' loops slice chunk by chunk: the index arithmetic of a
slot is done once per step, not once per element of the rows it moves. Activations go back with
an `all_to_all`; activation gradients reach every owner with an `all_gather`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sparsecore.kernels.geometry import KernelGeometry

Array = jax.Array


class OwnedEntries(NamedTuple):
    """The entries one device owns, as W = G*S windows (source device, source SparseCore) of
    P = `geometry.padded_window` slots.

    Window w can hold real entries only in its first `used[w]` slots. Per slot: `rows`, the
    owner-local table row (target SparseCore * rows_per_shard + embedding id), -1 where the slot
    holds no entry; `samples`, the sample within the source SparseCore's batch (0 where no
    entry); `gains`, 0 where no entry; `unique_slots`, t * U + k into the source device's unique
    lists of target t (None when routed without the side-car; 0 where no entry).
    """

    used: Array
    rows: Array
    samples: Array
    gains: Array
    unique_slots: Array | None

    @property
    def valid(self) -> Array:
        return self.rows >= 0

    @staticmethod
    def source_device(window: Array | int, geometry: KernelGeometry) -> Array | int:
        return window // geometry.sparsecores_per_device


def _partition_bounds(row_pointers: Array, geometry: KernelGeometry) -> tuple[Array, Array]:
    """Start and (exclusive) end of every partition in each local SparseCore's segment, [S, N]."""
    s, n = geometry.sparsecores_per_device, geometry.num_sparsecores
    ends = row_pointers.reshape(s, geometry.row_pointers_per_sparsecore)[:, :n]
    rounded = (ends + 7) // 8 * 8
    return jnp.concatenate([jnp.zeros((s, 1), ends.dtype), rounded[:, :-1]], axis=1), ends


def _classify(position: Array, starts: Array, ends: Array) -> tuple[Array, Array]:
    """For segment positions at or after `starts[..., 0]`: whether each holds a real entry of one
    of the S partitions bounded by `starts`/`ends [..., S]`, and that partition's index."""
    target = jnp.sum(position[..., None] >= starts[..., None, 1:], axis=-1, dtype=jnp.int32)
    end = jnp.take_along_axis(ends, target.reshape(*ends.shape[:-1], -1), axis=-1).reshape(target.shape)
    return position < end, target


def route_entries(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    entry_unique_index: Array | None,
    geometry: KernelGeometry,
    axis_name: str,
) -> OwnedEntries:
    """The entries this device owns, from its 1-D buffers (and the side-car's
    `entry_unique_index`, or None when only a lookup is needed)."""
    starts, ends = _partition_bounds(row_pointers, geometry)
    s, g, p = geometry.sparsecores_per_device, geometry.num_devices, geometry.padded_window
    with_unique = entry_unique_index is not None
    if g == 1:
        return _own_segments(starts, ends, embedding_ids, sample_ids, gains, entry_unique_index, geometry)
    # Each local SparseCore's window to each device: [S, G, S] partition bounds, [S, G, P] slots.
    starts, ends = starts.reshape(s, g, s), ends.reshape(s, g, s)
    position = starts[..., :1] + jnp.arange(p, dtype=jnp.int32)
    valid, target = _classify(position, starts, ends)
    index = jnp.minimum(
        jnp.arange(s, dtype=jnp.int32).reshape(s, 1, 1) * geometry.segment_size + position,
        geometry.coo_buffer_size - 1,
    )
    fields = [
        jnp.where(valid, target * geometry.rows_per_shard + embedding_ids[index], -1),
        jnp.where(valid, sample_ids[index], 0),
        lax.bitcast_convert_type(jnp.where(valid, gains[index], 0.0), jnp.int32),
    ]
    if with_unique:
        first_partition = jnp.arange(g, dtype=jnp.int32).reshape(1, g, 1) * s * geometry.unique_rows_per_partition
        fields.append(jnp.where(valid, entry_unique_index[index] - first_partition, 0))
    payload = jnp.stack(fields).swapaxes(1, 2)  # [fields, target device, source SparseCore, P]
    used = jnp.minimum(ends[..., -1] - starts[..., 0], p).swapaxes(0, 1)
    payload = lax.all_to_all(payload, axis_name, split_axis=1, concat_axis=1)
    used = lax.all_to_all(used, axis_name, split_axis=0, concat_axis=0)
    rows, samples, gain_bits, *unique = payload.reshape(len(fields), g * s, p)
    return OwnedEntries(
        used=used.reshape(g * s),
        rows=rows,
        samples=samples,
        gains=lax.bitcast_convert_type(gain_bits, jnp.float32),
        unique_slots=unique[0] if with_unique else None,
    )


def _own_segments(
    starts: Array,
    ends: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    entry_unique_index: Array | None,
    geometry: KernelGeometry,
) -> OwnedEntries:
    """A single device's entries: window s is SparseCore s's whole segment, read in place
    (reshaped, masked, padded to whole chunks) instead of gathered slot by slot."""
    s, segment, p = geometry.sparsecores_per_device, geometry.segment_size, geometry.padded_window
    read = min(segment, p)  # a window never holds more than max_ids per partition
    valid, target = _classify(jnp.broadcast_to(jnp.arange(read, dtype=jnp.int32), (s, read)), starts, ends)

    def field(buffer: Array, fill: int | float, owner_row: bool = False) -> Array:
        values = buffer.reshape(s, segment)[:, :read]
        if owner_row:
            values = target * geometry.rows_per_shard + values
        values = jnp.where(valid, values, fill)
        return jnp.pad(values, ((0, 0), (0, p - read)), constant_values=fill) if p > read else values

    return OwnedEntries(
        used=jnp.minimum(ends[:, -1], p),
        rows=field(embedding_ids, -1, owner_row=True),
        samples=field(sample_ids, 0),
        gains=field(gains, 0.0),
        unique_slots=None if entry_unique_index is None else field(entry_unique_index, 0),
    )


def routed_lookup(
    owner_partials: Callable[[OwnedEntries], Array],
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    geometry: KernelGeometry,
    axis_name: str,
) -> Array:
    """One device's lookup on a mesh: its entries go to their owners, `owner_partials(entries)`
    sums what this device owns into the partial activations `[G*S*B, D]` of every source sample,
    and those go back: this device's activations `[S*B, D]`. The lookups differ only in
    `owner_partials`."""
    entries = route_entries(row_pointers, embedding_ids, sample_ids, gains, None, geometry, axis_name)
    return return_activations(owner_partials(entries), geometry, axis_name)


def route_unique_rows(unique_ids: Array, geometry: KernelGeometry, axis_name: str) -> Array:
    """Send each device's side-car lists `[N, U]` to the partitions' owners: `[G source, S, U]`
    (ascending rows per list, `PAD_ID` after the real ones)."""
    g, s = geometry.num_devices, geometry.sparsecores_per_device
    lists = unique_ids.reshape(g, s, geometry.unique_rows_per_partition)
    return lax.all_to_all(lists, axis_name, split_axis=0, concat_axis=0)


def return_activations(partials: Array, geometry: KernelGeometry, axis_name: str) -> Array:
    """Owner partial sums `[G*S*B, D]` (source-major) -> this device's activations `[S*B, D]`
    (on one device, the partials themselves: XLA:CPU copies them for an all-to-all over one
    device, and again for the sum over its one source)."""
    g = geometry.num_devices
    if g == 1:
        return partials
    partials = partials.reshape(g, geometry.samples_per_device, partials.shape[-1])
    return lax.all_to_all(partials, axis_name, split_axis=0, concat_axis=0).sum(axis=0)


def gather_activation_grads(grads: Array, geometry: KernelGeometry, axis_name: str) -> Array:
    """Every device's activation gradients `[S*B, D]` -> `[G*S*B, D]` on every owner (on one
    device, its own: XLA:CPU copies them for an all-gather over one device)."""
    if geometry.num_devices == 1:
        return grads
    return lax.all_gather(grads, axis_name, tiled=True)
