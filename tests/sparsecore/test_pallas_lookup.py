"""The Pallas embedding bag (`sparsecore.kernels.pallas_lookup`), in Pallas's interpreter.

* The kernel alone matches `torch.Tensor.index_add_` of weighted table rows, with entries that
  must add nothing (negative rows, samples outside the window) mixed in.
* Selected as the lookup of every engine (`local_kernels(..., lookup_impl="pallas")`), it passes
  the SparseCore forward tests: `test_numerics`' forward tests against `torch.nn.EmbeddingBag`
  and the NumPy combiner model on 1 and 2 devices, and the lookup half of `test_kernels`' random
  topologies (NumPy model, bit-identical results with garbage outside the partitions) on 2 and 8
  devices.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from sparsecore.kernels import local_kernels
from sparsecore.kernels.pallas_lookup import embedding_bag
from sparsecore import optimizers as opt
from sparsecore.api import SparseCoreEmbedding
from sparsecore.layout import stack_tables
from sparsecore.preprocess import preprocess
from sparsecore.topology import Topology
from test_kernels import TOPOLOGIES, garbage_outside_partitions, lookup_selected, random_model, tiny_lookup
from test_numerics import (  # noqa: F401  (collected here, with the Pallas lookup selected)
    forward_run,
    pooled_model,
    random_ids,
    test_forward_matches_numpy_combiner_model,
    test_forward_matches_torch_embedding_bag,
    test_sequence_feature_returns_every_position_and_zero_padding,
)


pallas_lookup_selected = lookup_selected("pallas")


def test_engines_here_lower_the_pallas_kernel():
    assert "sparsecore_embedding_bag" in tiny_lookup(lowered=False)


@pytest.mark.parametrize(
    "devices, sparsecores, seed", TOPOLOGIES[1:], ids=[f"{d}dev_x{s}sc" for d, s, _ in TOPOLOGIES[1:]]
)
def test_random_topologies_match_numpy_model_even_with_garbage(devices, sparsecores, seed):
    rng = np.random.default_rng(seed)
    tables, features, groups = random_model(rng, devices, sparsecores, opt.SGD(learning_rate=0.5))
    topology = Topology.cpu(devices, sparsecores)
    stacks = stack_tables(features, topology, groups)
    engine = SparseCoreEmbedding(stacks, topology, entry_chunk=int(rng.choice([8, 32, 128])))
    state, _ = engine.init(jax.random.key(seed))
    values = engine.unstack_tables(state)
    inputs = {f.name: random_ids(rng, f, weighted=bool(rng.integers(2)), max_len=7) for f in features}
    clean = preprocess(stacks, inputs, topology)
    dirty = {name: garbage_outside_partitions(b, topology.num_sparsecores, rng) for name, b in clean.items()}

    activations = engine.lookup(state, clean)
    for name, got in engine.lookup(state, dirty).items():
        np.testing.assert_array_equal(np.asarray(got), np.asarray(activations[name]))
    for feature in features:
        want = pooled_model(values[feature.table.name], inputs[feature.name], feature.table.combiner.value)
        np.testing.assert_allclose(np.asarray(activations[feature.name]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("windows, entries, batch, vocabulary, dim", [(1, 5, 3, 7, 8), (3, 40, 6, 50, 16)])
def test_embedding_bag_matches_torch_index_add(windows, entries, batch, vocabulary, dim):
    rng = np.random.default_rng(entries)
    table = rng.normal(size=(vocabulary, dim)).astype(np.float32)
    rows = rng.integers(-2, vocabulary, (windows, entries)).astype(np.int32)
    samples = rng.integers(-1, batch + 2, (windows, entries)).astype(np.int32)
    gains = rng.uniform(-2, 2, (windows, entries)).astype(np.float32)

    got = embedding_bag(table, rows, samples, gains, batch_size=batch, interpret=True)

    want = torch.zeros(windows, batch, dim)
    for w in range(windows):
        keep = torch.from_numpy((rows[w] >= 0) & (samples[w] >= 0) & (samples[w] < batch))
        picked = torch.from_numpy(table)[torch.from_numpy(rows[w]).long()[keep]]
        weighted = torch.from_numpy(gains[w])[keep, None] * picked
        want[w].index_add_(0, torch.from_numpy(samples[w]).long()[keep], weighted)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6, atol=1e-6)


def test_local_kernels_rejects_an_unknown_lookup_impl():
    with pytest.raises(ValueError, match="lookup_impl must be one of .*'triton'"):
        local_kernels("cpu", lookup_impl="triton")
