"""Row primitives shared by the stand-in kernels: bounded gathers and scatters of table rows,
and the chunked gather-scale-scatter loop both the lookup and the gradient use.

XLA:CPU emits a gather as a parallel loop but a scatter with repeated indices as a serial one, and
every fresh buffer of the program page-faults in on each call (about 0.5 ms per MB on the stand-in
machine). So the `[entries, D]` products are never materialised whole: `accumulate_rows` walks
the entries in fixed chunks whose `[chunk, D]` temporaries stay in cache and are reused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

_ROWS = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
_ROW_UPDATES = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)


def gather_rows(table: Array, rows: Array, *, fill: bool = False) -> Array:
    """`table[rows]` for 1-D `rows`: clamped into range, or filled with 0 where out of range."""
    mode = lax.GatherScatterMode.FILL_OR_DROP if fill else lax.GatherScatterMode.CLIP
    return lax.gather(
        table, rows[:, None], _ROWS, (1, table.shape[1]), mode=mode, fill_value=0 if fill else None
    )


def scatter_rows(target: Array, rows: Array, updates: Array, *, add: bool, unique: bool = False) -> Array:
    """`target.at[rows].add(updates)` or `.set(updates)`; out-of-range rows are dropped."""
    scatter = lax.scatter_add if add else lax.scatter
    return scatter(
        target,
        rows[:, None],
        updates,
        _ROW_UPDATES,
        mode=lax.GatherScatterMode.FILL_OR_DROP,
        unique_indices=unique,
    )


def in_chunks(chunk: int, *columns: Array) -> tuple[Array, ...]:
    """Pad 1-D columns with zeros to a multiple of `chunk` and reshape them to [steps, chunk]."""
    length = columns[0].shape[0]
    padding = -length % chunk
    return tuple(jnp.pad(c, (0, padding)).reshape(-1, chunk) for c in columns)


def varying(x: Array, axis_name: str) -> Array:
    """Mark a freshly created value as per-device, so it can carry a loop inside `shard_map`."""
    return lax.pcast(x, (axis_name,), to="varying")


def accumulate_rows(
    target: Array, source: Array, read: Array, write: Array, weights: Array, chunk: int
) -> Array:
    """`target[write[i]] += weights[i] * source[read[i]]` over all i with `read[i] >= 0`,
    chunk by chunk; entries with a negative `read` add nothing (not even a NaN times zero)."""

    def step(total: Array, columns: tuple[Array, Array, Array]) -> tuple[Array, None]:
        r, w, g = columns
        rows = gather_rows(source, r)
        contribution = jnp.where((r >= 0)[:, None], g[:, None] * rows, 0.0)
        return scatter_rows(total, w, contribution, add=True), None

    padded_read = jnp.pad(read, (0, -read.shape[0] % chunk), constant_values=-1).reshape(-1, chunk)
    write, weights = in_chunks(chunk, write, weights)
    total, _ = lax.scan(step, target, (padded_read, write, weights))
    return total
