"""The XLA collective programs of the TPU transport, run on a mesh of the CPU platform's virtual
devices (one device per rank) and compared with NumPy. What runs on TPU is the same programs
over a mesh that spans processes; that multi-process plumbing (`xla_transport`) is untested."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchtpu.distributed import xla_collectives as programs


def _mesh(world: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:world]), (programs.AXIS,))


@pytest.fixture(scope="module")
def mesh():
    return _mesh(3)


def _run(fn, mesh, *stacked):
    sharding = NamedSharding(mesh, PartitionSpec(programs.AXIS))
    return np.asarray(fn(*[jax.device_put(np.asarray(a), sharding) for a in stacked]))


def _values(world: int, dtype, shape=(5,), seed=0) -> np.ndarray:
    """Small integers in every dtype, so any summation order gives the exact result."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random((world, *shape)) < 0.5
    return rng.integers(-3, 4, (world, *shape)).astype(dtype)


DTYPES = [np.float32, jax.numpy.bfloat16, np.int64, np.bool_]
NP_REDUCE = {
    "sum": lambda x: x.sum(0), "max": lambda x: x.max(0), "min": lambda x: x.min(0),
    "product": lambda x: x.prod(0), "avg": lambda x: x.sum(0) / x.shape[0],
    "band": lambda x: np.bitwise_and.reduce(x, 0), "bor": lambda x: np.bitwise_or.reduce(x, 0),
    "bxor": lambda x: np.bitwise_xor.reduce(x, 0),
}


def _expected(op: str, x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        as_int = x.astype(np.int64)
        return (NP_REDUCE["max" if op in ("sum", "bor") else op](as_int) != 0)
    if x.dtype == jax.numpy.bfloat16:
        return NP_REDUCE[op](x.astype(np.float32)).astype(x.dtype)
    return NP_REDUCE[op](x).astype(x.dtype)


def _applicable(op: str, dtype) -> bool:
    try:
        programs.check_reduce_op(op, np.dtype(dtype))
    except ValueError:
        return False
    return True


def _cases(ops):
    """(op, dtype) pairs the programs accept; `test_reduce_op_errors` covers the others."""
    return [pytest.param(op, d, id=f"{op}-{np.dtype(d).name}") for op in ops for d in DTYPES if _applicable(op, d)]


@pytest.mark.parametrize("op, dtype", _cases(programs.REDUCE_OPS))
def test_all_reduce(mesh, op, dtype):
    x = _values(mesh.size, dtype)
    got = _run(programs.all_reduce(mesh, op), mesh, x)
    np.testing.assert_array_equal(got, np.broadcast_to(_expected(op, x), x.shape))


@pytest.mark.parametrize("op, dtype", _cases(["sum", "avg", "max", "product", "bxor"]))
def test_reduce_scatter(mesh, op, dtype):
    world = mesh.size
    x = _values(world, dtype, shape=(world, 3), seed=1)  # rank r: one chunk per rank
    got = _run(programs.reduce_scatter(mesh, op), mesh, x)
    for r in range(world):
        np.testing.assert_array_equal(got[r], _expected(op, x[:, r]))


def test_reduce_op_errors():
    with pytest.raises(ValueError, match="avg needs a floating dtype, got int64"):
        programs.check_reduce_op("avg", np.dtype(np.int64))
    with pytest.raises(ValueError, match="band needs an integer dtype, got float32"):
        programs.check_reduce_op("band", np.dtype(np.float32))
    with pytest.raises(ValueError, match="premul_sum"):
        programs.check_reduce_op("premul_sum", np.dtype(np.float32))


def test_broadcast_is_bit_exact(mesh):
    world = mesh.size
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45], np.float32)
    x = np.stack([special if r == 1 else np.full(5, r, np.float32) for r in range(world)])
    got = _run(programs.broadcast(mesh, 1), mesh, x)
    assert np.array_equal(got.view(np.int32), np.broadcast_to(special, x.shape).view(np.int32))
    for dtype in (np.int64, np.bool_, jax.numpy.bfloat16):
        x = _values(world, dtype, seed=2)
        got = _run(programs.broadcast(mesh, world - 1), mesh, x)
        np.testing.assert_array_equal(got, np.broadcast_to(x[-1], x.shape))


def test_all_gather_and_all_to_all(mesh):
    world = mesh.size
    x = _values(world, np.int64, shape=(2,), seed=3)
    np.testing.assert_array_equal(_run(programs.all_gather(mesh), mesh, x), np.broadcast_to(x, (world, *x.shape)))
    chunks = _values(world, np.int64, shape=(world, 2), seed=4)  # rank r's chunk j goes to rank j
    np.testing.assert_array_equal(_run(programs.all_to_all(mesh), mesh, chunks), chunks.transpose(1, 0, 2))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ragged_all_to_all_random_patterns(world):
    """Uneven all-to-all with zeros, padded as the transport pads it; every element checked."""
    mesh = _mesh(world)
    rng = np.random.default_rng(5)
    for _ in range(20):
        sends = rng.integers(0, 5, (world, world))
        sends[rng.random((world, world)) < 0.3] = 0
        rows_in = programs.bucket(sends.sum(1).max())
        rows_out = programs.bucket(sends.sum(0).max())
        block = programs.bucket(sends.max())
        inputs = np.zeros((world, rows_in, 2), np.int64)
        for i in range(world):
            n = sends[i].sum()
            inputs[i, :n] = i * 1000 + np.arange(n)[:, None] * 10 + np.arange(2)[None, :]
        indices = [programs.ragged_indices(sends, r, block, rows_out) for r in range(world)]
        got = _run(programs.ragged_all_to_all(mesh), mesh, inputs,
                   np.stack([s for s, _ in indices]), np.stack([r for _, r in indices]))
        for j in range(world):
            starts = np.concatenate([np.zeros((world, 1), int), np.cumsum(sends, 1)[:, :-1]], 1)
            expected = np.concatenate([inputs[i, starts[i, j]: starts[i, j] + sends[i, j]] for i in range(world)])
            np.testing.assert_array_equal(got[j, : len(expected)], expected, err_msg=f"sends={sends.tolist()} rank {j}")


def test_bucket():
    assert [programs.bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000)] == [1, 1, 2, 4, 4, 8, 1024]
