"""Topology presets and table/feature specs: values from the notes, validation at construction."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sparsecore.optimizers import SGD, Adagrad
from sparsecore.spec import Combiner, FeatureSpec, NamedInitializer, TableSpec, optimizer_key
from sparsecore.topology import GIB, CHIP_PRESETS, Topology, cpu_chip


@pytest.mark.parametrize(
    "name, per_chip, per_device, hbm_per_chip, bandwidth, alignment",
    [
        ("v4", 4, 4, 32 * GIB, 1.2e12, 8),
        ("v5p", 4, 4, 95 * GIB, 2.77e12, 8),
        ("v6e", 2, 2, 32 * 10**9, 1.64e12, 16),
        ("tpu7x", 4, 2, 192 * GIB, 7.4e12, 16),
    ],
)
def test_presets(name, per_chip, per_device, hbm_per_chip, bandwidth, alignment):
    chip = CHIP_PRESETS[name]
    assert chip.sparsecores_per_chip == per_chip
    assert chip.sparsecores_per_device == per_device
    assert chip.hbm_bytes_per_chip == hbm_per_chip
    assert chip.hbm_bandwidth_bytes_per_s == bandwidth
    assert chip.embedding_dim_alignment == alignment
    assert chip.is_tpu


def test_tpu7x_counts_per_jax_device():
    topology = Topology.preset("tpu7x", global_device_count=8)
    assert topology.sparsecores_per_device == 2
    assert topology.num_sparsecores == 16
    assert topology.chip.hbm_bytes_per_device == 96 * GIB


def test_cpu_stand_in_defaults_and_overrides():
    topology = Topology.cpu(2)
    assert (topology.sparsecores_per_device, topology.num_sparsecores) == (4, 8)
    assert not topology.chip.is_tpu
    assert Topology.cpu(8, sparsecores_per_device=2).num_sparsecores == 16
    assert cpu_chip(hbm_bytes=3 * GIB).hbm_bytes_per_chip == 3 * GIB
    assert Topology.cpu(1, 1).row_pointers_per_sparsecore == 8
    assert Topology.cpu(8, 4).row_pointers_per_sparsecore == 32


def test_multi_host_topology():
    topology = Topology.cpu(4, 4, local_device_count=2)
    assert (topology.num_hosts, topology.local_sparsecores, topology.num_sparsecores) == (2, 8, 16)
    assert topology.with_devices(8).local_device_count == 8


@pytest.mark.parametrize(
    "devices, per_device, match",
    [
        (3, 2, r"\(6 = 3 devices x 2 SparseCores per device\) must be a power of 2"),
        (1, 3, r"\(3 = 1 devices x 3 SparseCores per device\) must be a power of 2"),
        (0, 4, "global_device_count must be positive"),
    ],
)
def test_topology_rejects_bad_counts(devices, per_device, match):
    with pytest.raises(ValueError, match=match):
        Topology.cpu(devices, per_device)


def test_topology_rejects_local_count_not_dividing_global():
    with pytest.raises(ValueError, match=r"local_device_count \(3\) must be positive and divide"):
        Topology.cpu(4, 4, local_device_count=3)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
        Topology.preset("v9", 1)


def test_table_spec_normalises_names():
    table = TableSpec(
        "t", 100, 8, combiner="sqrtn", optimizer="adagrad", initializer="uniform(-1, 1)"
    )
    assert table.combiner is Combiner.SQRTN
    assert isinstance(table.optimizer, Adagrad)
    assert table.initializer == NamedInitializer("uniform", (-1.0, 1.0))
    assert (table.max_ids_per_partition, table.max_unique_ids_per_partition) == (256, 256)
    assert isinstance(TableSpec("t", 100, 8).optimizer, SGD)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocabulary_size=0), "vocabulary_size must be a positive int, got 0"),
        (dict(embedding_dim=-8), "embedding_dim must be a positive int, got -8"),
        (dict(vocabulary_size=10.0), "vocabulary_size must be a positive int, got 10.0"),
        (dict(combiner="max"), "unknown combiner 'max'; expected one of"),
        (dict(optimizer="rmsprop"), "unknown optimizer 'rmsprop'"),
        (dict(optimizer=0.1), "optimizer must be an OptimizerSpec or a name"),
        (dict(initializer="glorot"), "unknown initializer 'glorot'"),
        (dict(initializer="uniform(1)"), "uniform takes 2 argument"),
        (dict(initializer="uniform(1, 0)"), "needs a < b"),
        (dict(initializer="normal(0)"), "needs std > 0"),
        (dict(max_ids_per_partition=0), "max_ids_per_partition must be a positive int"),
        (dict(suggested_coo_buffer_size_per_device=-1), "suggested_coo_buffer_size_per_device"),
    ],
)
def test_table_spec_rejects_bad_fields(kwargs, match):
    fields = dict(name="t", vocabulary_size=100, embedding_dim=8) | kwargs
    with pytest.raises(ValueError, match=match):
        TableSpec(**fields)


def test_named_initializers_draw_the_named_distribution():
    key = jax.random.key(0)
    assert np.all(np.asarray(NamedInitializer.parse("zeros")(key, (4, 3))) == 0)
    uniform = np.asarray(NamedInitializer.parse("uniform(2, 3)")(key, (1000,)))
    assert uniform.min() >= 2 and uniform.max() < 3
    normal = np.asarray(NamedInitializer.parse("normal(0.5)")(key, (20000,)))
    assert abs(normal.std() - 0.5) < 0.02 and abs(normal.mean()) < 0.02
    assert str(NamedInitializer.parse(" normal( 0.5 ) ")) == "normal(0.5)"


def test_default_initializer_is_torchrec_uniform():
    table = TableSpec("t", 400, 8)
    assert table.initializer == NamedInitializer("uniform", (-0.05, 0.05))


def test_callable_initializer_is_kept():
    def init(key, shape, dtype):
        return jax.numpy.ones(shape, dtype)

    assert TableSpec("t", 10, 8, initializer=init).initializer is init


def test_optimizer_key_distinguishes_hyperparameters():
    assert optimizer_key(SGD(learning_rate=0.1)) == optimizer_key(SGD(learning_rate=0.1))
    assert optimizer_key(SGD(learning_rate=0.1)) != optimizer_key(SGD(learning_rate=0.2))
    assert optimizer_key(SGD()) != optimizer_key(Adagrad())


def test_with_limits_keeps_everything_else():
    table = TableSpec("t", 100, 8, combiner="mean", max_ids_per_partition=64)
    updated = table.with_limits(max_unique_ids_per_partition=7)
    assert (updated.max_ids_per_partition, updated.max_unique_ids_per_partition) == (64, 7)
    assert (updated.combiner, updated.initializer) == (table.combiner, table.initializer)


def test_feature_spec():
    table = TableSpec("t", 100, 8)
    pooled = FeatureSpec("f", table, 32)
    sequence = FeatureSpec("s", table, 32, max_sequence_length=5)
    assert (pooled.output_shape, pooled.num_rows, pooled.is_sequence) == ((32, 8), 32, False)
    assert (sequence.output_shape, sequence.num_rows, sequence.is_sequence) == (
        (32, 5, 8),
        160,
        True,
    )
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        FeatureSpec("f", table, 0)
    with pytest.raises(ValueError, match="max_sequence_length must be a positive int"):
        FeatureSpec("f", table, 8, max_sequence_length=0)
    with pytest.raises(ValueError, match="table must be a TableSpec"):
        FeatureSpec("f", "t", 8)
