"""Processes of the training job: one, several spawned with `torch.multiprocessing`, or torchrun's.

Each process drives its own tpu devices (on the CPU stand-in: its own `devices` virtual devices,
with its own device-lock directory, as a host of its own). One device per process is the
default: several virtual devices in one process put independent collective programs in flight
together, and XLA:CPU can deadlock on them (a rendezvous timeout); a TPU has no such limit.

When torch.distributed is needed (several processes, or DMP in one), the default group serves cpu
tensors with gloo (object collectives, metrics, checkpoints) and tpu tensors with `tpu_dist` (the
dense gradients, DMP's all-to-alls). For the direct SparseCore collection the processes also join
one mesh (`embeddings.join_process_mesh`) before anything touches the device.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Processes", "launched_by_torchrun", "run", "spawn"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Processes:
    """How each process starts: `devices` tpu devices; `process_group` even for one process (DMP
    needs one); `join_mesh`: every process's devices form one mesh (the direct collection)."""

    devices: int = 1
    process_group: bool = False
    join_mesh: bool = False


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def run(job: Callable[..., Any], processes: Processes, *args: Any) -> Any:
    """Run `job(*args)` in this process, as one process of torchrun's job if it launched us."""
    _set_device_count(processes.devices)
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
    if world == 1 and not processes.process_group:
        return job(*args)
    if launched_by_torchrun():
        # Each process is a stand-in host of its own (its own device locks).
        os.environ.setdefault("TORCHTPU_LOCK_DIR", os.path.join(
            tempfile.gettempdir(), f"torchtpu-dlrm-{os.environ['MASTER_PORT']}", os.environ["RANK"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    else:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    _init_process_group()
    try:
        if processes.join_mesh:
            from embeddings import join_process_mesh

            join_process_mesh()
        return job(*args)
    finally:
        dist.destroy_process_group()


def spawn(job: Callable[..., Any], count: int, processes: Processes, *args: Any) -> None:
    """Run `job(*args)` in `count` new processes on this machine (torchrun's variables set, each
    process its own stand-in host)."""
    lock_root = tempfile.mkdtemp(prefix="torchtpu-dlrm-locks-")
    mp.start_processes(_entry, args=(job, count, processes, _free_port(), lock_root, args), nprocs=count,
                       start_method="spawn")


def _entry(rank: int, job: Callable[..., Any], world: int, processes: Processes, port: int, lock_root: str,
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
    run(job, processes, *args)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _init_process_group() -> None:
    """gloo for cpu tensors, `tpu_dist` for tpu tensors. TorchRec's `ShardingEnv` reads the
    default group's `group_name`, which torchtpu's Python group does not answer yet ("ProcessGroup
    name not set"): it is given the name c10d registered, as the plugin's own tests do."""
    from torch.distributed import distributed_c10d

    from torchtpu.distributed import ProcessGroupTPU

    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    if "group_name" not in vars(ProcessGroupTPU):
        ProcessGroupTPU.group_name = property(lambda group: distributed_c10d._world.pg_names[group])


def _set_device_count(devices: int) -> None:
    """This process's devices: the stand-in's count, or how many of a TPU host's devices to use
    (read when the runtime starts)."""
    from torchtpu import runtime

    if runtime.is_started():
        raise RuntimeError("the tpu runtime already started: the device count can no longer change")
    os.environ["TORCHTPU_NUM_DEVICES"] = str(devices)
