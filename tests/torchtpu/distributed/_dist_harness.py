"""Spawning ranks for tpu_dist tests: one process per rank, as torchrun would start them.

Each rank gets torchrun's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) and the
stand-in's: a device-lock directory of this test's own (so children never contend with devices
the pytest process holds) and enough virtual devices, set before the child first uses jax.

Layouts:
- "one_host": every rank on one host, rank r drives tpu:r (as torchrun with one process per
  device); there are 2 x world devices, so a test can also reach a device that is not its own.
- "host_per_rank": each rank is its own host (its own lock directory) with one device, tpu:0.
  PyTorch's Python PrivateUse1 device guard reports a single device, so autograd runs backward
  only on tpu:0; training tests use this layout.

A rank's exception fails the test with its traceback; ranks that do not finish within the time
limit are killed and the test fails, so a hang can never stall the suite.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import stand_in


def run_ranks(fn: Callable, world_size: int, *args, layout: str = "one_host", timeout: float = 240.0) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; raise on any failure."""
    assert layout in ("one_host", "host_per_rank"), layout
    with tempfile.TemporaryDirectory(prefix="tpu-dist-test-locks-") as lock_root:
        stand_in.run_ranks(_entry, (fn, world_size, stand_in.free_port(), lock_root, layout, args), world_size,
                           timeout, fn.__name__)


def _entry(rank: int, fn: Callable, world_size: int, port: int, lock_root: str, layout: str, args: tuple) -> None:
    devices = 2 * world_size if layout == "one_host" else 1
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank if layout == "one_host" else 0),
        LOCAL_WORLD_SIZE=str(world_size if layout == "one_host" else 1),
        TORCHTPU_LOCK_DIR=lock_root if layout == "one_host" else os.path.join(lock_root, str(rank)),
        TORCHTPU_NUM_DEVICES=str(devices),
        XLA_FLAGS=stand_in.xla_flags(devices),
    )
    fn(rank, world_size, *args)  # then it leaves JAX's multi-process runtime, if it joined (`stand_in`)
