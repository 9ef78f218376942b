"""The lookup as a Pallas kernel: gather of table rows and their weighted segment sum per sample.

A drop-in for the stand-in lookup (`sparsecore.kernels.lookup`), selected with
`local_kernels(platform, lookup_impl="pallas")`. The routing of entries to the owners of their
partitions and of activations back is unchanged (XLA collectives, `sparsecore.kernels.routing`);
the owner's arithmetic -- `partials[w, sample] += gain * table[row]` over every entry of every
window w -- is the Pallas kernel `embedding_bag`.

The kernel is written the way a TPU kernel reads sparse buffers: the owner's COO entries (table
row, sample within the window, gain) are scalar-prefetched into SMEM, and the table operand's
`BlockSpec` index map reads the row of the current entry from them, so the pipeline DMAs exactly
the rows the entries name -- a gather driven by the prefetched ids. Entries within a partition
are sorted by embedding id, so runs of one row keep the same block index and Pallas fetches
that row once. The output block of a window (`[B, D]`, its B source samples) stays in VMEM
while the window's entries accumulate into it, and is written back once.

Platform switch: `interpret=True` (every platform without Mosaic, e.g. the CPU stand-in) runs
the kernel in Pallas's interpreter; `interpret=False` (platform "tpu") compiles it with Mosaic.
UNTESTED ON TPU: there is no TPU here; the block shapes follow Mosaic's rules (the last two
block dims equal the array's) but no Mosaic compile has been run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sparsecore.kernels.geometry import KernelGeometry
from sparsecore.kernels.routing import routed_lookup

Array = jax.Array


def embedding_bag(
    table: Array, rows: Array, samples: Array, gains: Array, *, batch_size: int, interpret: bool
) -> Array:
    """Weighted sums of table rows per sample, window by window: `[W, batch_size, D]` float32.

    `rows`, `samples`, `gains` (`[W, P]`): entry p of window w adds `gains[w, p] *
    table[rows[w, p]]` to sample `samples[w, p]` of window w. Entries with a negative row, or a
    sample outside `[0, batch_size)`, add nothing; samples no entry names are zero.
    """
    windows, entries = rows.shape
    vocabulary, dim = table.shape
    if samples.shape != rows.shape or gains.shape != rows.shape:
        raise ValueError(
            f"embedding_bag: rows, samples and gains must have one shape, got {rows.shape}, "
            f"{samples.shape}, {gains.shape}"
        )

    def kernel(rows_ref, samples_ref, gains_ref, row_ref, out_ref):
        w, p = pl.program_id(0), pl.program_id(1)

        @pl.when(p == 0)
        def _():
            out_ref[...] = jnp.zeros_like(out_ref)

        sample = samples_ref[w, p]

        @pl.when((rows_ref[w, p] >= 0) & (sample >= 0) & (sample < batch_size))
        def _():
            out_ref[pl.ds(sample, 1), :] += gains_ref[w, p] * row_ref[...].astype(jnp.float32)

    def table_row(w, p, rows_ref, samples_ref, gains_ref):
        return jnp.clip(rows_ref[w, p], 0, vocabulary - 1), 0, 0

    def window_block(w, p, rows_ref, samples_ref, gains_ref):
        return w, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(windows, entries),
        in_specs=[pl.BlockSpec((None, 1, dim), table_row)],
        out_specs=pl.BlockSpec((None, batch_size, dim), window_block),
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        # Inside `shard_map` the partials vary over the mesh axes the entries vary over.
        out_shape=jax.ShapeDtypeStruct(
            (windows, batch_size, dim), jnp.float32, manual_axis_type=jax.typeof(rows).manual_axis_type
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="sparsecore_embedding_bag",
    )(rows, samples, gains.astype(jnp.float32), table.reshape(vocabulary, 1, dim))


def lookup_local(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    table: Array,
    *,
    geometry: KernelGeometry,
    axis_name: str,
    interpret: bool,
) -> Array:
    """One device's lookup with the Pallas embedding bag (signature of the stand-in's, plus the
    platform switch `interpret`)."""
    def owner_partials(entries):
        samples = jnp.where(entries.valid, entries.samples, -1)
        partials = embedding_bag(
            table, entries.rows, samples, entries.gains, batch_size=geometry.batch_size_per_sparsecore,
            interpret=interpret,
        )
        return partials.reshape(-1, table.shape[1]).astype(table.dtype)

    return routed_lookup(owner_partials, row_pointers, embedding_ids, sample_ids, gains, geometry, axis_name)
