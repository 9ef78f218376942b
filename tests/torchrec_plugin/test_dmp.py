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
def test_two_ranks_every_optimizer_on_a_plan_of_every_sharding_type():
    """The mixed plan holds a table-wise, a row-wise, a column-wise and a data-parallel table
    (one spawn for all: plans of one type each are `_dmp_workers.plans`, run by hand)."""
    cases = (("mixed", "sgd"), ("mixed", "adagrad"), ("mixed", "rowwise_adagrad"))
    run_processes(_dmp_workers.compare_with_torchrec, 2, 1, BATCH_PER_RANK, cases, timeout=600)


@pytest.mark.slow
def test_four_ranks_mixed_plan():
    run_processes(_dmp_workers.compare_with_torchrec, 4, 1, BATCH_PER_RANK, (("mixed", "rowwise_adagrad"),),
                  timeout=600)
