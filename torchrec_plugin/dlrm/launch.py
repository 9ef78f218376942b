"""Processes of the training job: one, several spawned with `torch.multiprocessing`, or torchrun's.

Each process drives its own tpu devices (on the CPU stand-in: its own `devices` virtual devices,
with its own device-lock directory, as a host of its own). With several processes, the default
group serves cpu tensors with gloo (object collectives, metrics, checkpoints) and tpu tensors
with `tpu_dist` (the dense gradients), and the processes join one mesh for the SparseCore tables
(`embeddings.join_process_mesh`) before anything touches the device.
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


def run(job: Callable[..., Any], *args: Any, devices: int | None = None) -> Any:
    """Run `job(*args)` in this process, as one process of torchrun's job if it launched us."""
    if devices is not None:
        _set_device_count(devices)
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    if world == 1:
        return job(*args)
    os.environ.setdefault("TORCHTPU_LOCK_DIR", os.path.join(tempfile.gettempdir(),
                                                            f"torchtpu-dlrm-{os.environ['MASTER_PORT']}",
                                                            os.environ["RANK"]))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    try:
        from embeddings import join_process_mesh

        join_process_mesh()
        return job(*args)
    finally:
        dist.destroy_process_group()


def spawn(job: Callable[..., Any], processes: int, devices: int, *args: Any) -> None:
    """Run `job(*args)` in `processes` new processes on this machine (torchrun's variables set,
    each process its own stand-in host)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lock_root = tempfile.mkdtemp(prefix="torchtpu-dlrm-locks-")
    mp.start_processes(_entry, args=(job, processes, devices, port, lock_root, args), nprocs=processes,
                       start_method="spawn")


def _entry(rank: int, job: Callable[..., Any], world: int, devices: int, port: int, lock_root: str,
           args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TORCHTPU_LOCK_DIR=os.path.join(lock_root, str(rank)),
    )
    run(job, *args, devices=devices)


def _set_device_count(devices: int) -> None:
    """Stand-in devices of this process (read when the runtime starts; a TPU ignores it)."""
    from torchtpu import runtime

    if runtime.is_started():
        raise RuntimeError("the tpu runtime already started: the device count can no longer change")
    os.environ["TORCHTPU_NUM_DEVICES"] = str(devices)
