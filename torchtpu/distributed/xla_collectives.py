"""XLA collective programs over a one-dimensional mesh of ranks (one device per rank).

Every program takes and returns arrays stacked over ranks, `[world, ...]`, sharded along the
`ranks` axis: rank r holds row r. The bodies run under `shard_map`, so XLA emits the collectives
(all-reduce, all-gather, reduce-scatter, all-to-all) across the mesh's devices. The programs are
pure JAX: the tests run them on a mesh of the CPU platform's virtual devices, and on TPU the XLA
transport runs them on a mesh that spans processes.

Uneven all-to-all is a dense all-to-all of fixed-size blocks: each rank gathers the rows it sends
to each peer into a block of `block` rows (padding past its split), and each receiver gathers its
output rows out of the blocks it got. Index arrays computed on the host from the agreed split
sizes (`ragged_indices`) say which rows go where, so the program depends only on the padded
sizes. (`lax.ragged_all_to_all` would skip the padding on TPU, but XLA:CPU cannot run it, so it
could not be checked here.)
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

AXIS = "ranks"
REDUCE_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")


def _sharded(mesh: Mesh, body: Callable, n_inputs: int = 1):
    spec = PartitionSpec(AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n_inputs, out_specs=spec))


def _local_reduce(stacked, op: str):
    """Reduce the rank axis (0) of values gathered on one device."""
    if op in ("sum", "avg"):
        total = jnp.sum(stacked, axis=0, dtype=stacked.dtype)
        return total / stacked.shape[0] if op == "avg" else total
    if op == "max":
        return jnp.max(stacked, axis=0)
    if op == "min":
        return jnp.min(stacked, axis=0)
    if op == "product":
        return jnp.prod(stacked, axis=0, dtype=stacked.dtype)
    bitwise = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]
    return bitwise.reduce(stacked, axis=0)


def check_reduce_op(op: str, dtype) -> None:
    """Raise a clear error for an op the programs cannot apply to `dtype`."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not supported (supported: {', '.join(REDUCE_OPS)})")
    if op == "avg" and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"reduce op avg needs a floating dtype, got {np.dtype(dtype).name}")
    if op in ("band", "bor", "bxor") and not jnp.issubdtype(dtype, jnp.integer) and dtype != jnp.bool_:
        raise ValueError(f"reduce op {op} needs an integer dtype, got {np.dtype(dtype).name}")


def _reduce(x, op: str, world: int):
    """All-reduce of the local value `x` over the ranks axis (of `world` ranks)."""
    if x.dtype == jnp.bool_:
        return _reduce(x.astype(jnp.int32), "max" if op in ("sum", "bor") else op, world) != 0
    if op == "sum":
        return lax.psum(x, AXIS)
    if op == "avg":
        # The sum, then a division (XLA may multiply by the reciprocal instead: PyTorch's
        # correctly rounded quotient can differ in the last bit).
        return lax.psum(x, AXIS) / world
    if op == "max":
        return lax.pmax(x, AXIS)
    if op == "min":
        return lax.pmin(x, AXIS)
    return _local_reduce(lax.all_gather(x, AXIS), op)


@functools.lru_cache(maxsize=None)
def all_reduce(mesh: Mesh, op: str):
    """[world, ...] -> [world, ...]: every row becomes the reduction of all rows."""
    return _sharded(mesh, lambda x: _reduce(x[0], op, mesh.devices.size)[None])


@functools.lru_cache(maxsize=None)
def broadcast(mesh: Mesh, root: int):
    """[world, ...] -> [world, ...]: every row becomes row `root`, bit for bit.

    A sum of the root's bits (as unsigned integers) and zeros from everyone else: one all-reduce,
    exact for every value (NaN payloads and -0.0 included)."""

    def body(x):
        value = x[0]
        as_bits = value.astype(jnp.uint8) if value.dtype == jnp.bool_ else value
        unsigned = jnp.dtype(f"uint{as_bits.dtype.itemsize * 8}")
        bits = lax.bitcast_convert_type(as_bits, unsigned)
        mine = jnp.where(lax.axis_index(AXIS) == root, bits, jnp.zeros_like(bits))
        out = lax.bitcast_convert_type(lax.psum(mine, AXIS), as_bits.dtype)
        return (out.astype(jnp.bool_) if value.dtype == jnp.bool_ else out)[None]

    return _sharded(mesh, body)


@functools.lru_cache(maxsize=None)
def all_gather(mesh: Mesh):
    """[world, ...] -> [world, world, ...]: every rank gets all rows."""
    return _sharded(mesh, lambda x: lax.all_gather(x[0], AXIS)[None])


@functools.lru_cache(maxsize=None)
def reduce_scatter(mesh: Mesh, op: str):
    """[world, world, ...] -> [world, ...]: rank r gets the reduction of every rank's chunk r."""

    def body(x):
        chunks = x[0]
        if chunks.dtype == jnp.bool_:
            received = lax.all_to_all(chunks, AXIS, 0, 0)
            return (_local_reduce(received.astype(jnp.int32), "max" if op in ("sum", "bor") else op) != 0)[None]
        if op in ("sum", "avg"):
            total = lax.psum_scatter(chunks, AXIS, scatter_dimension=0)
            return (total / chunks.shape[0] if op == "avg" else total)[None]
        return _local_reduce(lax.all_to_all(chunks, AXIS, 0, 0), op)[None]

    return _sharded(mesh, body)


@functools.lru_cache(maxsize=None)
def all_to_all(mesh: Mesh):
    """[world, world, ...] -> [world, world, ...]: rank r's chunk j goes to rank j as its chunk r."""
    return _sharded(mesh, lambda x: lax.all_to_all(x[0], AXIS, 0, 0)[None])


@functools.lru_cache(maxsize=None)
def ragged_all_to_all(mesh: Mesh):
    """Uneven all-to-all of rows: (rows [world, R_in, ...], send [world, world * block],
    recv [world, R_out]) -> [world, R_out, ...], with the index arrays of `ragged_indices`."""
    world = mesh.devices.size

    def body(rows, send, recv):
        block = send.shape[1] // world
        blocks = jnp.take(rows[0], send[0], axis=0, mode="fill", fill_value=0)
        blocks = blocks.reshape(world, block, *rows.shape[2:])
        received = lax.all_to_all(blocks, AXIS, 0, 0).reshape(world * block, *rows.shape[2:])
        return jnp.take(received, recv[0], axis=0)[None]

    return _sharded(mesh, body, 3)


def ragged_indices(sends: np.ndarray, rank: int, block: int, out_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays of `ragged_all_to_all` for `rank`, from the agreed row counts
    (`sends[i, j]`: rows rank i sends to rank j), a block size >= every count and the padded
    number of output rows.

    send: for each peer j, the input rows for j, then an out-of-range index (a zero row) up to
    `block`. recv: for each output row, its place among the received blocks (peer i's rows
    first, in rank order), then row 0 up to `out_rows` (padding the caller drops)."""
    world = sends.shape[0]
    mine = sends[rank]
    starts = np.concatenate([[0], np.cumsum(mine)[:-1]])
    pad = np.iinfo(np.int32).max
    send = np.full((world, block), pad, dtype=np.int32)
    for j in range(world):
        send[j, : mine[j]] = starts[j] + np.arange(mine[j])
    recv = np.zeros(out_rows, dtype=np.int32)
    received = np.concatenate([i * block + np.arange(sends[i, rank]) for i in range(world)])
    recv[: received.size] = received
    return send.reshape(-1), recv


def bucket(n: int) -> int:
    """Padded size for `n` (a power of two, at least 1), so programs are reused across steps."""
    return 1 << max(int(n) - 1, 0).bit_length()
