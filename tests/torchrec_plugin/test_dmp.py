"""`DistributedModelParallel` on `tpu` with the plugin's sharders against TorchRec's own DMP on
CPU over gloo (FBGEMM's CPU kernels): same plan, initial weights and batches; forward outputs,
the tables and the fused optimizer's state (TorchRec's names, shapes and shard layout) after 10
fused-optimizer steps agree within 1e-5, with SGD, Adagrad and row-wise Adagrad, on a plan
holding every sharding type (table-wise, row-wise, column-wise, data-parallel and table-row-wise),
and on plans of each single type (at two ranks, one optimizer each; all pairs by hand).
Distributed checkpoints (`torch.distributed.checkpoint` of the model's and the fused optimizer's
state dicts) restore bit-exactly and training goes on identically; one written by two ranks loads
at four ranks, where the tpu model holds what TorchRec's model holds from it, and after 10 more
row-wise Adagrad steps both agree within 1e-5 in forward outputs, tables and optimizer state (the
table-row-wise table moves to the second host, whose ranks the first host's send ids).
`TrainPipelineSparseDist` drives the tpu model through the same steps as TorchRec's. Each rank is
a spawned stand-in process driving one device; ranks form hosts of two
(`_dmp_workers.LOCAL_WORLD_SIZE`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "embeddings"))

import _dmp_workers  # noqa: E402
from _spawn import run_processes  # noqa: E402

BATCH_PER_RANK = 8
PLAN_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
PER_TYPE_CASES = tuple((plan, optimizer) for plan in PLAN_TYPES for optimizer in ("sgd", "adagrad", "rowwise_adagrad"))
"""Every plan of one type with every optimizer: `run_processes(_dmp_workers.compare_with_torchrec,
2, 1, BATCH_PER_RANK, PER_TYPE_CASES)` runs them by hand (about two minutes)."""


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> Path:
    """One spawn of two ranks for all of the following (test budget): each plan of one sharding
    type (table-wise, row-wise, column-wise, table-row-wise, data-parallel) with one of the
    optimizers in turn (all fifteen pairs pass by hand: `PER_TYPE_CASES`), then SGD, Adagrad and
    row-wise Adagrad on the plan holding every type, the last one checkpointed and restored, then
    the train pipeline. Returns the checkpoint."""
    path = tmp_path_factory.mktemp("dmp") / "checkpoint"
    optimizers = ("sgd", "adagrad", "rowwise_adagrad")
    per_type = tuple((plan, optimizers[i % 3]) for i, plan in enumerate(PLAN_TYPES))
    cases = (*per_type, *(("mixed", optimizer) for optimizer in optimizers))
    run_processes(_dmp_workers.compare_with_torchrec, 2, 1, BATCH_PER_RANK, cases, str(path), timeout=900)
    return path


@pytest.mark.slow
def test_two_ranks_match_torchrec_checkpoint_and_pipeline(two_rank_checkpoint):
    assert (two_rank_checkpoint / ".metadata").is_file()


@pytest.mark.slow
def test_four_ranks_resume_from_two(two_rank_checkpoint):
    run_processes(_dmp_workers.resume_on_another_world_size, 4, 1, BATCH_PER_RANK, str(two_rank_checkpoint),
                  timeout=600)
