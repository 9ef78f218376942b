"""The TPU planner on a 26-table MLPerf-like DLRM (Criteo 1TB vocabularies, dim 128, row-wise
Adagrad): plans for v5p x8 and v6e x8 fit each device's HBM, differ where the chips differ, and a
table larger than a device's HBM gets an error naming it. Column-wise shards are never narrower
than, nor a fraction of, the chip's padded width, whatever `min_partition` allows; a table narrower
than that width keeps its SparseCore options under a row-wise optimizer (no data-parallel
fallback to the dense optimizer)."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import torchrec_plugin
from torchrec_plugin.estimators import shard_cost
from torchrec_plugin.planning import TpuStorageReservation

MLPERF_VOCABULARIES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4,
    976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
"""Rows of the 26 tables of MLPerf's DLRM-DCNv2 (Criteo 1TB, capped at 40M)."""

BATCH = 2048


def mlperf_like(vocabularies=MLPERF_VOCABULARIES, dim: int = 128) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
        for i, rows in enumerate(vocabularies)
    ]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01})
    return ebc


def _plan(chip: str, model: EmbeddingBagCollection):
    topology = torchrec_plugin.topology(chip, world_size=8)
    planner = torchrec_plugin.planner(topology=topology, batch_size=BATCH)
    return topology, planner, planner.plan(model, torchrec_plugin.sharders())


def _hbm_per_rank(planner, topology) -> list[int]:
    used = [0] * topology.world_size
    for option in planner._best_plan:
        for shard in option.shards:
            used[shard.rank] += shard.storage.hbm
    return used


@pytest.fixture(scope="module")
def plans():
    model = mlperf_like()
    return {chip: _plan(chip, model) for chip in ("v5p", "v6e")}


def test_plans_fit_hbm_and_place_on_indexed_tpu_devices(plans):
    for chip, (topology, planner, plan) in plans.items():
        capacity = topology.chip.hbm_bytes_per_device
        used = _hbm_per_rank(planner, topology)
        reserved = planner._storage_reservation.reserved_bytes
        assert all(0 < u + reserved <= capacity for u in used), (chip, used, capacity)
        shardings = plan.plan[""]
        assert len(shardings) == len(MLPERF_VOCABULARIES)
        for sharding in shardings.values():
            if sharding.sharding_spec is None:
                continue
            for shard in sharding.sharding_spec.shards:
                assert str(shard.placement.device()) == f"tpu:{shard.placement.rank()}"


def test_plans_differ_where_the_chips_differ(plans):
    """A 40M x 128 table with its mirror needs ~38 GiB: whole on one 95 GiB v5p device, split
    over several 32 GB v6e devices."""
    big = [f"t{i}" for i, rows in enumerate(MLPERF_VOCABULARIES) if rows == 40000000]
    v5p, v6e = plans["v5p"][2].plan[""], plans["v6e"][2].plan[""]
    assert {v5p[t].sharding_type for t in big} != {v6e[t].sharding_type for t in big} or any(
        len(v5p[t].ranks) != len(v6e[t].ranks) for t in big
    )
    for table in big:
        assert len(v6e[table].ranks) > 1, (table, v6e[table].sharding_type, v6e[table].ranks)


def test_storage_counts_what_lives_in_hbm():
    topology, planner, _ = _plan("v6e", mlperf_like(MLPERF_VOCABULARIES[:4]))
    for option in planner._best_plan:
        for shard in option.shards:
            cost = shard_cost(option, shard.size, topology)
            assert shard.storage.hbm == cost.hbm > 0
            if option.sharding_type != ShardingType.DATA_PARALLEL.value:
                rows, cols = shard.size
                assert cost.table >= rows * cols * 4 and cost.mirror == rows * cols * 4
                assert cost.optimizer >= rows * 4 and cost.buffers > 0 and cost.activations > 0


def test_a_table_larger_than_hbm_is_named_with_the_overflow():
    model = mlperf_like((1000, 2_000_000_000, 50), dim=64)
    topology = torchrec_plugin.topology("v6e", world_size=8)
    planner = torchrec_plugin.planner(topology=topology, batch_size=BATCH)
    with pytest.raises(PlannerError, match=r"table '.*t1' does not fit: .* GiB too much"):
        planner.plan(model, torchrec_plugin.sharders())


@pytest.mark.parametrize("chip, dim, min_partition, width", [
    ("v5p", 16, 4, 8),    # TorchRec: four shards of 4 columns
    ("v6e", 48, 8, 16),   # TorchRec: six shards of 8 columns
    ("v5p", 40, 16, 40),  # TorchRec: two shards of 20 (padded to 24); no multiple of 8 from 16 divides 40
    ("v6e", 256, None, 128),
])
def test_column_wise_shards_are_multiples_of_the_padded_width(chip, dim, min_partition, width):
    """SparseCore pads a shard's columns to the chip's alignment, so a narrower shard wastes the
    padding; TorchRec's planner cuts column-wise tables into multiples of 4 columns."""
    constraints = {"t0": ParameterConstraints(sharding_types=[ShardingType.COLUMN_WISE.value],
                                              min_partition=min_partition)}
    topology = torchrec_plugin.topology(chip, world_size=2)
    planner = torchrec_plugin.planner(topology=topology, batch_size=BATCH, constraints=constraints)
    plan = planner.plan(mlperf_like((1000,), dim=dim), torchrec_plugin.sharders())
    shards = plan.plan[""]["t0"].sharding_spec.shards
    assert [shard.shard_sizes for shard in shards] == [[1000, width]] * (dim // width)
    assert [shard.shard_offsets for shard in shards] == [[0, k * width] for k in range(dim // width)]
    assert all(option.shards[0].storage.hbm == shard_cost(option, option.shards[0].size, topology).hbm
               for option in planner._best_plan)


def test_topology_presets():
    for chip, sparsecores in (("v4", 4), ("v5p", 4), ("v6e", 2), ("tpu7x", 2), ("cpu", 4)):
        topology = torchrec_plugin.topology(chip, world_size=4)
        assert topology.compute_device == "tpu" and topology.sparsecores_per_device == sparsecores
        assert all(device.storage.hbm == topology.chip.hbm_bytes_per_device for device in topology.devices)
    with pytest.raises(ValueError, match="unknown chip 'v9'"):
        torchrec_plugin.topology("v9", world_size=2)
    assert TpuStorageReservation().reserved_bytes == 0


def _narrow(optimizer: type[torch.optim.Optimizer]) -> EmbeddingBagCollection:
    """t0 12 columns wide (padded to 16 on v5p), t1 16, of 100k rows (enough that the planner
    prefers SparseCore to data-parallel, which it picks for 1000 rows), under `optimizer`."""
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=100_000, embedding_dim=dim, feature_names=[f"f{i}"])
              for i, dim in enumerate((12, 16))]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": 0.01})
    return ebc


def test_a_narrow_table_under_a_row_wise_optimizer_keeps_its_sparsecore_options():
    """SparseCore's row-wise slot averages over a table's own dim, not its padded width, so a
    12-wide table (16 padded on v5p) under RowWiseAdagrad is offered every SparseCore sharding,
    as under Adagrad, and planned on SparseCore (as the 16-wide t1), not data-parallel with the
    dense optimizer; with only table- and column-wise allowed it gets one of them."""
    topology = torchrec_plugin.topology("v5p", world_size=2)
    planner = torchrec_plugin.planner(topology=topology, batch_size=BATCH)
    plan = planner.plan(_narrow(RowWiseAdagrad), torchrec_plugin.sharders())
    for table in ("t0", "t1"):
        assert plan.plan[""][table].sharding_type != ShardingType.DATA_PARALLEL.value
        assert plan.plan[""][table].compute_kernel == EmbeddingComputeKernel.FUSED.value
    for optimizer in (RowWiseAdagrad, torch.optim.Adagrad):
        options = planner._enumerator.enumerate(_narrow(optimizer), torchrec_plugin.sharders())
        types = {o.sharding_type for o in options if o.name == "t0"}
        assert {ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
                ShardingType.ROW_WISE.value} <= types, (optimizer, types)

    constraints = {"t0": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value,
                                                              ShardingType.COLUMN_WISE.value])}
    planner = torchrec_plugin.planner(topology=topology, batch_size=BATCH, constraints=constraints)
    plan = planner.plan(_narrow(RowWiseAdagrad), torchrec_plugin.sharders())
    assert plan.plan[""]["t0"].sharding_type in {ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value}


@pytest.mark.parametrize("chip", ["cpu", "v6e"])
def test_one_device_keeps_every_table_whole(chip):
    """On one device every sharding places all of a table's rows there. Splitting it only adds
    work: a row-wise table bucketizes its ids (and the host waits for the counts), and each
    column shard streams all of the table's ids again. So the planner keeps each table in one
    shard (table-wise, or column-wise with one shard, which is the same placement). Before the
    estimator counted either, it chose row-wise for all 26 tables of the mlperf DLRM."""
    constraints = {f"t{i}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value,
                                                                 ShardingType.ROW_WISE.value,
                                                                 ShardingType.COLUMN_WISE.value])
                   for i in range(6)}
    planner = torchrec_plugin.planner(topology=torchrec_plugin.topology(chip, world_size=1), batch_size=BATCH,
                                      constraints=constraints)
    planner.plan(mlperf_like((100_000, 40_000, 7_000, 1_000, 64, 3), dim=64), torchrec_plugin.sharders())
    assert all(option.sharding_type != ShardingType.ROW_WISE.value and len(option.shards) == 1
               for option in planner._best_plan), [(o.name, o.sharding_type, len(o.shards)) for o in planner._best_plan]
