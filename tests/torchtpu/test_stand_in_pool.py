"""The CPU stand-in's thread pool has room for collectives (`runtime.stand_in_pool_size`), and
making sharded tensors launches no program spanning the mesh (`sharding.from_jax`).

XLA:CPU runs all devices' programs on one pool of max(cores, devices) threads by default. On two
cores with four devices, two independent chains of collective programs launched from one thread
took every thread and waited on each other until XLA aborted the process. The runtime sizes the
pool before JAX starts: a fresh process with the default pool deadlocks on the script below (XLA
aborts it after 40 s) and finishes it in about a second with the runtime's.

Programs spanning the mesh launched from two threads at once can deadlock whatever the pool (the
second program's per-device launches can take a device's last slots for programs in flight before
the first's). `test_dlrm` aborted so about once in 25 runs: its prefetching loader made sharded
tensors with a mesh-wide reshape while the step ran. `from_jax` now reshapes each device's block
on its device."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torchtpu import runtime, sharding

SCRIPT = r"""
import os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from torchtpu import runtime

devices = runtime.runtime().devices
print(f"NPROC={os.environ.get('NPROC')}", flush=True)
rows = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
scaled = jax.jit(lambda v: v * (jnp.sum(v) / 1e3), out_shardings=rows)  # an all-reduce inside
x = y = jax.device_put(jnp.arange(len(devices) * 256, dtype=jnp.float32), rows)
for _ in range(int(sys.argv[1])):  # two independent chains, in flight together
    x = scaled(x)
    y = scaled(y)
jax.block_until_ready((x, y))
print("finished", flush=True)
"""


def test_one_device_leaves_the_pool_alone():
    """No program spans devices on one device in one process: nothing to starve, no pool set."""
    assert runtime.stand_in_pool_size(1) is None
    assert runtime.stand_in_pool_size(1, processes=2) is not None


@pytest.mark.parametrize("given", [None, "64"])
def test_independent_collective_programs_finish(tmp_path, given):
    """With the runtime's pool the script finishes; a larger pool the user set is kept."""
    env = {**os.environ, "TORCHTPU_NUM_DEVICES": "4", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "TORCHTPU_LOCK_DIR": str(tmp_path)}
    env.pop("NPROC", None)
    if given is not None:
        env["NPROC"] = given
    done = subprocess.run([sys.executable, "-c", SCRIPT, "3000"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"NPROC={given or runtime.stand_in_pool_size(4)}" in done.stdout
    assert "finished" in done.stdout


def test_from_jax_launches_no_mesh_wide_program(monkeypatch):
    """Rows already split over the mesh are flattened device by device (bit for bit); only other
    layouts move through the mesh first (`jax.device_put` to the flat sharding)."""
    moved = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: (moved.append(x.shape), device_put(x, *a, **k))[1])
    devices = len(sharding.mesh_devices())
    values = np.arange(devices * 6, dtype=np.float32).reshape(devices * 2, 3)
    split = device_put(jnp.asarray(values), NamedSharding(sharding.mesh(), P(sharding.AXIS)))
    assert torch.equal(sharding.from_jax(split).cpu(), torch.from_numpy(values))
    assert moved == []
    replicated = device_put(jnp.asarray(values), NamedSharding(sharding.mesh(), P()))
    assert torch.equal(sharding.from_jax(replicated).cpu(), torch.from_numpy(values))
    assert moved == [values.shape]
