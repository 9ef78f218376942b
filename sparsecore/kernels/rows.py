"""Row primitives shared by the stand-in kernels: bounded gathers and scatters of table rows,
and the chunked gather-scale-scatter loop both the lookup and the gradient use.

On XLA:CPU the row gathers and scatters themselves are cheap, but every fresh buffer of a program
page-faults in on each call (about 0.5 ms per MB on the stand-in machine), so materialising the
`[entries, D]` products would cost more than the arithmetic. `accumulate_rows` walks the entries
in fixed chunks whose `[chunk, D]` temporaries stay in cache and are reused by every loop step.
"""
from __future__ import annotations

from collections.abc import Callable

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


def varying(x: Array, axis_name: str) -> Array:
    """Mark a freshly created value as per-device, so it can carry a loop inside `shard_map`."""
    return lax.pcast(x, (axis_name,), to="varying")


def accumulate_rows(
    target: Array,
    source: Array,
    used: Array,
    read_chunk: Callable[[Array, Array], tuple[Array, Array, Array]],
    chunk: int,
) -> Array:
    """`target[write] += weights * source[read]` over windows of slots, chunk by chunk.

    Window w holds `used[w]` slots that may be real; `read_chunk(w, offset)` gives the `(read,
    write, weights)` of the `chunk` slots at `offset`. The loop visits only chunks that cover
    used slots. Slots with a negative `read` add nothing: their `write` is pointed past the end
    of `target`, and the scatter drops it (so not even a NaN times zero arrives).
    """
    per_window = (used + chunk - 1) // chunk
    ends = jnp.cumsum(per_window, dtype=jnp.int32)
    starts = ends - per_window

    def step(index: Array, total: Array) -> Array:
        window = jnp.sum(index >= ends, dtype=jnp.int32)
        read, write, weights = read_chunk(window, (index - starts[window]) * chunk)
        write = jnp.where(read >= 0, write, total.shape[0])
        return scatter_rows(total, write, weights[:, None] * gather_rows(source, read), add=True)

    return lax.fori_loop(0, ends[-1], step, target)
