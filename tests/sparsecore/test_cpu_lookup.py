"""The C++ lookup of the CPU stand-in (`sparsecore.kernels.cpu`), the default on "cpu" devices.

* The kernel alone matches `torch.Tensor.index_add_` of weighted table rows, with entries that
  must add nothing (negative rows, rows past the table, samples outside the window, slots past
  a window's used length) mixed in, over as many windows as threads and fewer.
* Engines on the stand-in lower their lookup to the custom calls (on one device, the one that
  reads the packed buffers in place; on a mesh, the one over routed windows); every other
  engine test of `tests/sparsecore` (forward against `torch.nn.EmbeddingBag`, random topologies
  with garbage outside the partitions on 1, 2 and 8 devices, training against FBGEMM) then runs
  them.
* Bad operands are refused with the reason; without a C++ compiler the stand-in warns and takes
  the XLA lookup.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import sparsecore.kernels
from sparsecore.kernels import cpu, local_kernels, lookup, native
from test_kernels import tiny_lookup


def index_add_model(table, rows, samples, gains, used, batch):
    """The lookup's partials from PyTorch's `index_add_` of the entries that count."""
    windows, entries = rows.shape
    want = torch.zeros(windows, batch, table.shape[1])
    for w in range(windows):
        slot = np.arange(entries)
        keep = (slot < used[w]) & (rows[w] >= 0) & (rows[w] < table.shape[0]) & (samples[w] >= 0) & (samples[w] < batch)
        picked = torch.from_numpy(table)[torch.from_numpy(rows[w][keep]).long()]
        weighted = torch.from_numpy(gains[w][keep])[:, None] * picked
        want[w].index_add_(0, torch.from_numpy(samples[w][keep]).long(), weighted)
    return want.numpy()


@pytest.mark.parametrize(
    "windows, entries, batch, vocabulary, dim",
    [(1, 5, 3, 7, 8), (3, 40, 6, 50, 16), (8, 300, 33, 97, 40), (2, 64, 1, 5, 1)],
)
def test_embedding_bag_matches_torch_index_add(windows, entries, batch, vocabulary, dim):
    rng = np.random.default_rng(entries)
    table = rng.normal(size=(vocabulary, dim)).astype(np.float32)
    rows = rng.integers(-2, vocabulary + 2, (windows, entries)).astype(np.int32)
    samples = rng.integers(-1, batch + 2, (windows, entries)).astype(np.int32)
    gains = rng.uniform(-2, 2, (windows, entries)).astype(np.float32)
    used = rng.integers(0, entries + 3, windows).astype(np.int32)  # past the slots too: clamped

    got = jax.jit(functools.partial(cpu.embedding_bag, batch_size=batch))(table, rows, samples, gains, used)

    np.testing.assert_allclose(np.asarray(got), index_add_model(table, rows, samples, gains, used, batch),
                               rtol=1e-6, atol=1e-6)


def test_embedding_bag_overwrites_a_reused_output_buffer():
    """XLA may hand the call memory that held anything: every output row is written."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(10, 4)).astype(np.float32)
    rows = np.array([[3, -1, 2]], np.int32)
    samples = np.array([[0, 1, 0]], np.int32)
    gains = np.ones((1, 3), np.float32)
    bag = jax.jit(functools.partial(cpu.embedding_bag, batch_size=4))
    for _ in range(3):
        jax.block_until_ready(bag(table * 1e6, rows, samples, gains, np.array([3], np.int32)))
        got = np.asarray(bag(table, rows, samples, gains, np.array([3], np.int32)))
        np.testing.assert_array_equal(got[0, 1:], 0)
        np.testing.assert_allclose(got[0, 0], table[3] + table[2], rtol=1e-6)


def test_engines_on_the_stand_in_lower_the_custom_call():
    """One device reads its packed buffers in place; a mesh sums the windows routing delivers."""
    one, mesh = tiny_lookup(devices=1), tiny_lookup(devices=2)
    assert "custom_call @sparsecore_SparseCoreEmbeddingBagSegments(" in one
    assert "custom_call @sparsecore_SparseCoreEmbeddingBag(" not in one
    assert "custom_call @sparsecore_SparseCoreEmbeddingBag(" in mesh


def test_embedding_bag_refuses_bad_operands():
    rows = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="float32"):
        cpu.embedding_bag(jnp.zeros((5, 3), jnp.bfloat16), rows, rows, rows.astype(jnp.float32), jnp.zeros(2, jnp.int32),
                          batch_size=2)
    with pytest.raises(ValueError, match=r"used \[W\]"):
        cpu.embedding_bag(jnp.zeros((5, 3), jnp.float32), rows, rows, rows.astype(jnp.float32), jnp.zeros(3, jnp.int32), batch_size=2)


def test_without_the_kernel_the_stand_in_warns_and_takes_the_xla_lookup(monkeypatch):
    def no_compiler(*_):
        raise FileNotFoundError("no C++ compiler (c++ or g++ on PATH, or $CXX)")

    monkeypatch.setattr(native, "register", no_compiler)
    sparsecore.kernels._cpu_lookup.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built .*no C\\+\\+ compiler"):
            kernels = local_kernels("cpu")
        assert kernels.lookup is lookup.lookup_local
    finally:
        sparsecore.kernels._cpu_lookup.cache_clear()
    monkeypatch.undo()
    assert local_kernels("cpu").lookup is cpu.lookup_local
