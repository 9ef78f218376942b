"""Processes of the training job: one, several spawned with `torch.multiprocessing`, or torchrun's.

Each process drives one tpu device -- TorchRec's one rank per device -- and on the CPU stand-in is
a host of its own (one virtual device, its own device-lock directory).

Every process joins torch.distributed, even alone (`DistributedModelParallel` needs a group): the
default group serves cpu tensors with gloo (object collectives, metrics) and tpu tensors with
`tpu_dist` (the dense gradients, DMP's all-to-alls).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launched_by_torchrun", "run", "spawn"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def run(job: Callable[..., Any], *args: Any) -> Any:
    """Run `job(*args)` in this process, as one process of torchrun's job if it launched us."""
    _one_device()
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        # Each process is a stand-in host of its own (its own device locks).
        os.environ.setdefault("TORCHTPU_LOCK_DIR", os.path.join(
            tempfile.gettempdir(), f"torchtpu-dlrm-{os.environ['MASTER_PORT']}", os.environ["RANK"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    else:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    _init_process_group()
    try:
        return job(*args)
    finally:
        dist.destroy_process_group()


def spawn(job: Callable[..., Any], count: int, *args: Any) -> None:
    """Run `job(*args)` in `count` new processes on this machine (torchrun's variables set, each
    process its own stand-in host)."""
    lock_root = tempfile.mkdtemp(prefix="torchtpu-dlrm-locks-")
    mp.start_processes(_entry, args=(job, count, _free_port(), lock_root, args), nprocs=count, start_method="spawn")


def _entry(rank: int, job: Callable[..., Any], world: int, port: int, lock_root: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TORCHTPU_LOCK_DIR=os.path.join(lock_root, str(rank)),
    )
    run(job, *args)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _init_process_group() -> None:
    """gloo for cpu tensors, `tpu_dist` for tpu tensors."""
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")


def _one_device() -> None:
    """One device for this process: the stand-in's count, or how many of a TPU host's devices to
    use (read when the runtime starts)."""
    from torchtpu import runtime

    if runtime.is_started():
        raise RuntimeError("the tpu runtime already started: the device count can no longer change")
    os.environ["TORCHTPU_NUM_DEVICES"] = "1"
