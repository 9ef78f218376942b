"""Starting stand-in hosts for the embedding tests (`stand_in.run_ranks`): each process is its own
host (its own device lock directory) with `devices` virtual devices, its environment set before
anything starts jax, and torchrun's variables for torch.distributed. A process's exception fails
the test with its traceback; processes still running at the deadline are killed and the test
fails."""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import stand_in


def run_processes(fn: Callable, processes: int, devices: int, *args, timeout: float = 900.0) -> None:
    """Run `fn(rank, processes, *args)` in `processes` hosts of `devices` devices each."""
    lock_root = tempfile.mkdtemp(prefix="embeddings-test-locks-")
    stand_in.run_ranks(_entry, (fn, processes, devices, stand_in.free_port(), lock_root, args), processes, timeout,
                       fn.__name__)


def _entry(rank: int, fn: Callable, world: int, devices: int, port: int, lock_root: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        TORCHTPU_LOCK_DIR=os.path.join(lock_root, str(rank)),
        TORCHTPU_NUM_DEVICES=str(devices),
        XLA_FLAGS=stand_in.xla_flags(devices),
    )
    fn(rank, world, *args)
