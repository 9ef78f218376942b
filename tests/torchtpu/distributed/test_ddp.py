"""DistributedDataParallel over tpu_dist trains a `tpu` model exactly as one process would.

Two spawned ranks, each on its own host (see `_dist_harness`: PyTorch's Python device guard
lets autograd run backward on tpu:0 only), train 10 SGD steps on halves of each batch; the
result equals one process training on `tpu` on the whole batches (float32 tolerances of
`torch.testing.assert_close`: DDP reassociates the sums over the batch).
"""

from __future__ import annotations

import pytest

import _dist_workers as workers
from _dist_harness import run_ranks

pytestmark = pytest.mark.slow


def test_ddp_matches_single_process_training_in_strict_and_defer_modes():
    run_ranks(workers.ddp_training, 2, ("strict", "defer"), layout="host_per_rank")


def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch():
    """`nn.SyncBatchNorm` over two ranks equals `nn.BatchNorm1d` on the concatenated batch."""
    run_ranks(workers.sync_batch_norm_training, 2, ("strict", "defer"), layout="host_per_rank")
