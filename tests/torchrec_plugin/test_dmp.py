"""`DistributedModelParallel` on `tpu` with the plugin's sharders against TorchRec's own DMP on
CPU over gloo (FBGEMM's CPU kernels), at two and at four ranks (hosts of two ranks,
`_dmp_workers.LOCAL_WORLD_SIZE`).

One EmbeddingBagCollection holds a table for every sharding type (table-wise, row-wise,
column-wise in shards of 4 columns, table-row-wise, data-parallel) and every fused optimizer (SGD,
Adagrad, row-wise Adagrad; each table's own through `apply_optimizer_in_backward`), all sharded
by one plan; at four ranks table-row-wise tables sit on both hosts. From the same initial weights
and batches, forward outputs at each of 10 steps, then the tables and the fused optimizers' state
(TorchRec's names, shapes and shard layout) agree within 1e-5. The data-parallel tables, whose
in-backward mark TorchRec ignores, take SGD steps by hand on both sides.

At two ranks the tpu model's distributed checkpoint (`torch.distributed.checkpoint` of the model's
and the fused optimizer's state dicts) restores bit-exactly into a model built from other weights
and trains on identically, and `TrainPipelineSparseDist` drives a tpu model of one table per
sharding type (Adagrad) through the same steps as TorchRec's. At four ranks, after their own 10
steps, both models load that two-rank checkpoint: the same state bit for bit, and within 1e-5
after more steps. Each rank is a spawned stand-in process driving one device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "embeddings"))

import _dmp_workers  # noqa: E402
from _spawn import run_processes  # noqa: E402

BATCH_PER_RANK = 8


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> Path:
    """One spawn of two ranks: the comparison with TorchRec, the checkpoint round trip and the
    train pipeline. Returns the checkpoint."""
    path = tmp_path_factory.mktemp("dmp") / "checkpoint"
    run_processes(_dmp_workers.compare_with_torchrec, 2, 1, BATCH_PER_RANK, str(path), timeout=900)
    return path


@pytest.mark.slow
def test_two_ranks_match_torchrec_checkpoint_and_pipeline(two_rank_checkpoint):
    assert (two_rank_checkpoint / ".metadata").is_file()


@pytest.mark.slow
def test_four_ranks_match_torchrec_and_resume_from_two(two_rank_checkpoint):
    run_processes(_dmp_workers.compare_and_resume_on_another_world_size, 4, 1, BATCH_PER_RANK,
                  str(two_rank_checkpoint), timeout=900)
