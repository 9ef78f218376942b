"""The lookup on the CPU stand-in: the owner's arithmetic as a C++ XLA:CPU custom call.

What `sparsecore.kernels.lookup` computes with XLA ops, and in the same way: on a mesh, the
routing of entries to the owners of their partitions and of activations back is unchanged (XLA
collectives, `sparsecore.kernels.routing`) and only the owner's `partials[w, sample] += gain *
table[row]` over each window's entries is the custom call `embedding_bag`; on one device, where
nothing moves, `embedding_bag_segments` reads the packed buffers in place, partition by
partition (`csrc/embedding_bag.cc`, both). They run on XLA's intra-op threads and, like the
libtpu call on a TPU (`sparsecore.kernels.tpu`), read the table in place; they order each
window's entries by sample and sum each sample's rows in a small accumulator, vectorised for the
host's widest instructions. XLA:CPU's best schedule of the same loop (`lookup.pooled_partials`)
pays a dynamic-slice, gather and scatter per chunk of entries, and ran 3-3.5x FBGEMM's time on
the benchmark's lookup.

On one device `lookup_features` has the kernel write each feature's activations into an output
of its own: sliced out of the stack's `[S*B, D]` instead, they are strided blocks that XLA copies
(~4 MB and 0.4 ms a step on the benchmark, a tenth of the lookup).

Selected by `sparsecore.kernels.local_kernels("cpu")` (the stand-in's default; `lookup_impl="xla"`
selects the XLA loop). Tables are float32, the stand-in's only table dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsecore.kernels import native
from sparsecore.kernels.geometry import FeatureBlock, KernelGeometry
from sparsecore.kernels.lookup import feature_activations
from sparsecore.kernels.routing import routed_lookup

Array = jax.Array

EMBEDDING_BAG = ("embedding_bag", "SparseCoreEmbeddingBag")
"""The C++ source and handler of `embedding_bag` (`native.register`'s arguments)."""
EMBEDDING_BAG_SEGMENTS = ("embedding_bag", "SparseCoreEmbeddingBagSegments")
"""The same source's handler of `embedding_bag_segments`."""


def embedding_bag(table: Array, rows: Array, samples: Array, gains: Array, used: Array, *, batch_size: int) -> Array:
    """Weighted sums of table rows per sample, window by window: `[W, batch_size, D]` float32.

    `rows`, `samples`, `gains` (`[W, P]`): entry p < `used[w]` of window w adds `gains[w, p] *
    table[rows[w, p]]` to sample `samples[w, p]` of window w. Entries with a row outside the
    table or a sample outside `[0, batch_size)` add nothing; samples no entry names are zero.
    """
    if table.ndim != 2 or table.dtype != jnp.float32:
        raise ValueError(f"embedding_bag: the table must be float32 [V, D], got {table.dtype} {table.shape}")
    if samples.shape != rows.shape or gains.shape != rows.shape or rows.ndim != 2 or used.shape != rows.shape[:1]:
        raise ValueError(
            f"embedding_bag: rows, samples and gains must be [W, P] and used [W], got {rows.shape}, "
            f"{samples.shape}, {gains.shape}, {used.shape}"
        )
    target = native.register(*EMBEDDING_BAG)
    out = jax.ShapeDtypeStruct((rows.shape[0], batch_size, table.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(
        table, rows.astype(jnp.int32), samples.astype(jnp.int32), gains.astype(jnp.float32), used.astype(jnp.int32)
    )


def embedding_bag_segments(
    table: Array, row_pointers: Array, embedding_ids: Array, sample_ids: Array, gains: Array, *,
    geometry: KernelGeometry, blocks: tuple[FeatureBlock, ...],
) -> tuple[Array, ...]:
    """`embedding_bag` of one device's packed buffers read in place, as a SparseCore reads them:
    window s is SparseCore s's segment, and the slots of partition t in it, from the 8-aligned
    end of partition t - 1 to `row_pointers[t]` (within the first `geometry.padded_window`
    slots), hold rows `t * rows_per_shard + embedding_ids` -- the windows that
    `routing.route_entries` builds on one device, without building them. Per block of the
    windows' samples (in order, disjoint), those samples' sums: `[S * samples, dim]` float32."""
    if table.ndim != 2 or table.dtype != jnp.float32:
        raise ValueError(f"embedding_bag_segments: the table must be float32 [V, D], got {table.dtype} {table.shape}")
    s = geometry.sparsecores_per_device
    outs = [jax.ShapeDtypeStruct((s, block.samples, block.dim), jnp.float32) for block in blocks]
    sums = jax.ffi.ffi_call(native.register(*EMBEDDING_BAG_SEGMENTS), outs)(
        table,
        row_pointers.astype(jnp.int32),
        embedding_ids.astype(jnp.int32),
        sample_ids.astype(jnp.int32),
        gains.astype(jnp.float32),
        partitions=np.int64(geometry.num_sparsecores),
        readable=np.int64(min(geometry.segment_size, geometry.padded_window)),
        rows_per_shard=np.int64(geometry.rows_per_shard),
        batch=np.int64(geometry.batch_size_per_sparsecore),
        sample_offsets=np.array([block.sample_offset for block in blocks], np.int64),
    )
    return tuple(block_sums.reshape(-1, block_sums.shape[-1]) for block_sums in sums)


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
    """One device's lookup (the signature of `lookup.lookup_local`). On a mesh of one device
    nothing needs routing: the kernel reads the packed buffers in place."""
    if geometry.num_devices == 1:
        whole_batch = FeatureBlock(0, geometry.batch_size_per_sparsecore, table.shape[1])
        (activations,) = embedding_bag_segments(
            table, row_pointers, embedding_ids, sample_ids, gains, geometry=geometry, blocks=(whole_batch,)
        )
        return activations

    def owner_partials(entries):
        partials = embedding_bag(
            table, entries.rows, entries.samples, entries.gains, entries.used,
            batch_size=geometry.batch_size_per_sparsecore,
        )
        return partials.reshape(-1, table.shape[1])

    return routed_lookup(owner_partials, row_pointers, embedding_ids, sample_ids, gains, geometry, axis_name)


def lookup_features(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    table: Array,
    *,
    geometry: KernelGeometry,
    axis_name: str,
) -> tuple[Array, ...]:
    """One device's activations of each feature, `[S * samples, dim]` (`geometry.features`): on
    one device written by the kernel into an output per feature, on a mesh sliced out of
    `lookup_local`'s (whose owners' sums are routed back as the stack's)."""
    if geometry.num_devices == 1:
        return embedding_bag_segments(
            table, row_pointers, embedding_ids, sample_ids, gains, geometry=geometry, blocks=geometry.features
        )
    activations = lookup_local(
        row_pointers, embedding_ids, sample_ids, gains, table, geometry=geometry, axis_name=axis_name
    )
    return feature_activations(activations, geometry)
