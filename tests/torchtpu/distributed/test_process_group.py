"""tpu_dist collectives across processes: each equals PyTorch's gloo on CPU tensors bit for bit,
uneven all-to-all delivers every element where a NumPy model says, bad calls fail clearly.

Multi-process (spawned ranks, see `_dist_harness`), hence `slow`; they still run in CI.
"""

from __future__ import annotations

import pytest

import _dist_workers as workers
from _dist_harness import run_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_gloo_bit_for_bit_and_uneven_all_to_all_is_exact(world_size):
    """One job per world size (spawning ranks is the slow part): every collective against gloo
    (in every eager mode at world size 2), then 200 random uneven all-to-all split patterns."""
    modes = ("strict", "defer", "debug") if world_size == 2 else ("strict",)
    run_ranks(workers.collectives_and_all_to_all, world_size, modes, 200)


def test_xla_transport_matches_gloo_on_the_cpu_stand_in():
    """The TPU's transport, on JAX's multi-process runtime (XLA collectives over gloo)."""
    run_ranks(workers.xla_transport_vs_gloo, 3, 20)


def test_errors_are_clear_and_do_not_hang():
    run_ranks(workers.errors, 2)


def test_tpu_only_group_refuses_cpu_tensors_and_moves_objects_on_tpu():
    # Each rank on its own host: object collectives move tensors to "tpu", which PyTorch's
    # Python device guard resolves to tpu:0 whatever the current device is.
    run_ranks(workers.tpu_only_group, 2, layout="host_per_rank")


def test_distributed_checkpoint_on_a_tpu_only_group(tmp_path):
    run_ranks(workers.checkpoint_on_a_tpu_only_group, 2, str(tmp_path / "checkpoint"), layout="host_per_rank")


def test_init_times_out_when_a_rank_never_joins():
    run_ranks(workers.init_alone, 1)
