"""The CPU stand-in's thread pool has room for collectives (`runtime.stand_in_pool_size`).

XLA:CPU runs all devices' programs on one pool of max(cores, devices) threads by default. On two
cores with four devices, two independent programs with collectives in flight -- even launched
from one thread -- took every thread and waited on each other until XLA aborted the process
(`test_dlrm` did so about once in 25 runs, its loader thread launching while the step ran). The
runtime sizes the pool before JAX starts; a fresh process with the default pool deadlocks on the
script below (XLA aborts it after 40 s), and finishes it in about a second with the runtime's."""

from __future__ import annotations

import os
import subprocess
import sys

from torchtpu import runtime

SCRIPT = r"""
import os, sys, threading
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from torchtpu import runtime

devices = runtime.runtime().devices
print(f"NPROC={os.environ.get('NPROC')}", flush=True)
rows = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
scaled = jax.jit(lambda v: v * (jnp.sum(v) / 1e3), out_shardings=rows)  # an all-reduce inside
start = jax.device_put(jnp.arange(len(devices) * 256, dtype=jnp.float32), rows)


def chains(steps: int) -> None:
    x = y = start  # two independent chains: each device may reach their programs in either order
    for _ in range(steps):
        x = scaled(x)
        y = scaled(y)
    jax.block_until_ready((x, y))


threads = [threading.Thread(target=chains, args=(int(sys.argv[1]),)) for _ in range(runtime.LAUNCHING_THREADS)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("finished", flush=True)
"""


def test_pool_size_rule():
    assert runtime.stand_in_pool_size(1) is None  # no program spans devices: nothing to starve
    assert runtime.stand_in_pool_size(4) == max(os.cpu_count() or 1, 4 * (runtime.LAUNCHING_THREADS + 1))
    assert runtime.stand_in_pool_size(1, processes=2) == max(os.cpu_count() or 1, runtime.LAUNCHING_THREADS + 1)


def test_independent_collective_programs_finish(tmp_path):
    env = {**os.environ, "TORCHTPU_NUM_DEVICES": "4", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "TORCHTPU_LOCK_DIR": str(tmp_path)}
    env.pop("NPROC", None)  # the runtime sets it
    done = subprocess.run([sys.executable, "-c", SCRIPT, "1500"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"NPROC={runtime.stand_in_pool_size(4)}" in done.stdout
    assert "finished" in done.stdout
