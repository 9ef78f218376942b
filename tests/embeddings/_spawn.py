"""Spawning stand-in hosts for the embedding tests: each process is its own host (its own device
lock directory) with `devices` virtual devices, its environment set before anything starts jax,
and torchrun's variables for torch.distributed. A process's exception fails the test with its
traceback; processes still running at the deadline are killed and the test fails."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Callable

import torch.multiprocessing as mp

import stand_in


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(fn: Callable, processes: int, devices: int, *args, timeout: float = 900.0) -> None:
    """Run `fn(rank, processes, *args)` in `processes` spawned hosts of `devices` devices each."""
    lock_root = tempfile.mkdtemp(prefix="embeddings-test-locks-")
    context = mp.start_processes(
        _entry,
        args=(fn, processes, devices, _free_port(), lock_root, args),
        nprocs=processes,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"{processes} process(es) of {fn.__name__} did not finish within {timeout} s")


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
