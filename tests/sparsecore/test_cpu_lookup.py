"""The C++ lookup of the CPU stand-in (`sparsecore.kernels.cpu`), the default on "cpu" devices.

* The kernel alone matches `torch.Tensor.index_add_` of weighted table rows, with entries that
  must add nothing (negative rows, rows past the table, samples outside the window, slots past
  a window's used length) mixed in, over as many windows as threads and fewer, at dims whose
  sums it holds in registers (8, 16, 40) and at dims it sums at run time (1 and 13, whose rows
  are narrower than 8 and 16 columns; 136, more columns than registers).
* The kernel over one device's packed buffers matches the same model of the windows that the
  XLA routing builds from them, and writes each block of samples it is given (a feature's, of
  its table's dim) into its own output.
* Engines on the stand-in lower their lookup to the custom calls (on one device, the one that
  reads the packed buffers in place; on a mesh, the one over routed windows); every other
  engine test of `tests/sparsecore` (forward against `torch.nn.EmbeddingBag`, random topologies
  with garbage outside the partitions on 1, 2 and 8 devices, training against FBGEMM) then runs
  them. On one device the custom call returns each feature's activations with nothing after it
  (no copy out of the stack's), the same as the XLA lookup's, narrower and sequence features
  included.
* Bad operands are refused with the reason; without a C++ compiler the stand-in warns and takes
  the XLA lookup.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import sparsecore.kernels
from sparsecore.api import SparseCoreEmbedding
from sparsecore.kernels import cpu, local_kernels, lookup, native, routing
from sparsecore.kernels.geometry import FeatureBlock, KernelGeometry
from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology
from test_kernels import tiny_lookup
from test_numerics import random_ids


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
    [
        (1, 5, 3, 7, 8), (3, 40, 6, 50, 16), (8, 300, 33, 97, 40), (2, 64, 1, 5, 1), (2, 50, 7, 30, 13),
        (3, 60, 5, 20, 136),
    ],
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


# Two SparseCores of 10 samples each, over 2 x 13 table rows of 8 columns.
SEGMENTS = KernelGeometry(
    name="segments", num_devices=1, sparsecores_per_device=2, row_pointers_per_sparsecore=8, coo_buffer_size=128,
    batch_size_per_sparsecore=10, rows_per_shard=13, embedding_dim=8, logical_embedding_dim=8,
    max_ids_per_partition=24, max_unique_ids_per_partition=24, unique_rows_per_partition=24, entry_chunk=8,
    row_chunk=8, features=(),
)


def packed_segments(rng: np.random.Generator, geometry: KernelGeometry):
    """Random packed buffers of one device: each SparseCore's partitions at random lengths, their
    entries with rows and samples in and out of range, garbage in every other slot."""
    s, n, segment = geometry.sparsecores_per_device, geometry.num_sparsecores, geometry.segment_size
    row_pointers = rng.integers(-5, 99, (s, geometry.row_pointers_per_sparsecore)).astype(np.int32)
    for sparsecore in range(s):
        start = 0
        for partition in range(n):
            row_pointers[sparsecore, partition] = start + rng.integers(0, geometry.max_ids_per_partition - 3)
            start = (int(row_pointers[sparsecore, partition]) + 7) // 8 * 8
    ids = rng.integers(-2, geometry.rows_per_shard + 2, s * segment).astype(np.int32)
    samples = rng.integers(-1, geometry.batch_size_per_sparsecore + 2, s * segment).astype(np.int32)
    gains = rng.uniform(-2, 2, s * segment).astype(np.float32)
    return row_pointers.reshape(-1), ids, samples, gains


def test_embedding_bag_segments_writes_each_block_of_the_windows_routing_builds():
    """The model: `index_add_` over the windows `routing.route_entries` builds from the buffers on
    one device. Blocks of samples [0, 3), [3, 7) of 5 columns and [8, 10) of 3 (sample 7 in none)
    each get their samples' sums, in an output of their own, into reused memory."""
    rng = np.random.default_rng(0)
    geometry = SEGMENTS
    s, b = geometry.sparsecores_per_device, geometry.batch_size_per_sparsecore
    table = rng.normal(size=(geometry.rows_per_device, geometry.embedding_dim)).astype(np.float32)
    buffers = packed_segments(rng, geometry)
    entries = routing.route_entries(*buffers, None, geometry, "unused")
    want = index_add_model(
        table, *(np.asarray(a) for a in (entries.rows, entries.samples, entries.gains, entries.used)), b
    )
    blocks = (FeatureBlock(0, 3, 8), FeatureBlock(3, 4, 5), FeatureBlock(8, 2, 3))
    bag = jax.jit(functools.partial(cpu.embedding_bag_segments, geometry=geometry, blocks=blocks))
    for _ in range(2):
        jax.block_until_ready(bag(table * 1e6, *buffers))
        got = bag(table, *buffers)
        assert [a.shape for a in got] == [(s * 3, 8), (s * 4, 5), (s * 2, 3)]
        for block, sums in zip(blocks, got):
            start, end = block.sample_offset, block.sample_offset + block.samples
            np.testing.assert_allclose(
                np.asarray(sums).reshape(s, block.samples, block.dim), want[:, start:end, : block.dim],
                rtol=1e-6, atol=1e-6,
            )
    (whole,) = cpu.embedding_bag_segments(table, *buffers, geometry=geometry, blocks=(FeatureBlock(0, b, 8),))
    np.testing.assert_allclose(np.asarray(whole).reshape(s, b, 8), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "blocks",
    [(FeatureBlock(3, 4, 8), FeatureBlock(0, 3, 8)), (FeatureBlock(0, 3, 9),), (FeatureBlock(8, 3, 8),)],
    ids=["out of order", "wider than the table", "past the batch"],
)
def test_embedding_bag_segments_refuses_bad_blocks(blocks):
    rng = np.random.default_rng(0)
    table = np.zeros((SEGMENTS.rows_per_device, 8), np.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"outputs \[S, samples, dim <= D\] expected"):
        jax.block_until_ready(
            cpu.embedding_bag_segments(table, *packed_segments(rng, SEGMENTS), geometry=SEGMENTS, blocks=blocks)
        )


def narrow_and_sequence_features(devices: int, lookup_impl: str):
    """An engine (`lookup_impl`'s lookup) over one stack of tables of 8, 5 and 3 columns, read by
    pooled features (two of one table) and a sequence feature, its tables and a batch."""
    topology = Topology.cpu(devices, 2)
    tables = [TableSpec("wide", 40, 8), TableSpec("narrow", 30, 5), TableSpec("thin", 20, 3)]
    features = [
        FeatureSpec("a", tables[0], 4),
        FeatureSpec("b", tables[1], 8),
        FeatureSpec("c", tables[1], 4, max_sequence_length=3),
        FeatureSpec("d", tables[2], 4),
    ]
    stacks = stack_tables(features, topology, [StackGroup(("wide", "narrow", "thin"))])
    engine = SparseCoreEmbedding(stacks, topology, kernels=local_kernels("cpu", lookup_impl=lookup_impl))
    state, _ = engine.init(jax.random.key(0))
    rng = np.random.default_rng(devices)
    inputs = {f.name: random_ids(rng, f, weighted=True, max_len=5) for f in features}
    return engine, state, engine.put_batch(preprocess(stacks, inputs, topology))


@pytest.mark.parametrize("devices", [1, 2])
def test_each_feature_matches_the_xla_lookup(devices):
    engine, state, batch = narrow_and_sequence_features(devices, "platform")
    xla_engine, _, _ = narrow_and_sequence_features(devices, "xla")
    got, want = engine.lookup(state, batch), xla_engine.lookup(state, batch)
    assert got.keys() == want.keys() == {"a", "b", "c", "d"}
    assert got["c"].shape == (4, 3, 5) and got["d"].shape == (4, 3)
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-6, atol=1e-6)


def test_one_device_lookup_returns_the_custom_calls_outputs_as_they_are():
    """Each feature's activations are one of the custom call's outputs: no slice, copy or other
    op between them and the program's results."""
    engine, state, batch = narrow_and_sequence_features(1, "platform")
    compiled = engine.lookup_program.lower(state, batch).compile().as_text()
    entry = compiled[compiled.index("\nENTRY") :]
    ops = set(re.findall(r"= \(?[a-z0-9]+\[[^=]*? ([a-z-]+)\(", entry))
    assert ops == {"parameter", "bitcast", "custom-call", "get-tuple-element", "tuple"}, ops
    results = re.search(r"= \((.*?)\) custom-call", entry).group(1)
    assert results == "f32[2,2,8]{2,1,0}, f32[2,4,5]{2,1,0}, f32[2,6,5]{2,1,0}, f32[2,2,3]{2,1,0}"


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
    sparsecore.kernels._cpu_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built .*no C\\+\\+ compiler"):
            kernels = local_kernels("cpu")
        assert kernels.lookup is lookup.lookup_local and kernels.lookup_features is None
    finally:
        sparsecore.kernels._cpu_kernels.cache_clear()
    monkeypatch.undo()
    kernels = local_kernels("cpu")
    assert kernels.lookup is cpu.lookup_local and kernels.lookup_features is cpu.lookup_features
