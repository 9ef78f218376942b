"""`DistributedModelParallel` on `tpu` with the plugin's sharders against TorchRec's own DMP on
CPU over gloo (FBGEMM's CPU kernels): same plan, initial weights and batches; forward outputs
and the tables after 10 fused-optimizer steps agree within 1e-5, for each sharding type and a
mixed plan, with SGD, Adagrad and row-wise Adagrad. Each rank is a spawned stand-in process
driving one device; ranks form hosts of two (`_dmp_workers.LOCAL_WORLD_SIZE`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "embeddings"))

import _dmp_workers  # noqa: E402
from _spawn import run_processes  # noqa: E402

BATCH_PER_RANK = 8


@pytest.mark.slow
def test_two_ranks_every_sharding_type():
    cases = (
        ("table_wise", "sgd"),
        ("row_wise", "adagrad"),
        ("column_wise", "rowwise_adagrad"),
        ("data_parallel", "sgd"),
        ("mixed", "adagrad"),
    )
    run_processes(_dmp_workers.compare_with_torchrec, 2, 1, BATCH_PER_RANK, cases, timeout=600)


@pytest.mark.slow
def test_four_ranks_mixed_plan():
    run_processes(_dmp_workers.compare_with_torchrec, 4, 1, BATCH_PER_RANK, (("mixed", "rowwise_adagrad"),),
                  timeout=600)
