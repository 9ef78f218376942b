"""How the tests start stand-in processes: the XLA flags of every process (pytest's own, and the
ranks and jobs they spawn), and the start of multi-process ranks.

The tests compile thousands of small programs and run each a few times, so most of their time
went to compiling. Two flags make XLA:CPU compile faster and change nothing the tests check:
optimisation level 0 skips LLVM's passes (halved the suite), and the legacy loop emitters in place
of the fusion emitters halve what remains (`--xla_cpu_use_fusion_emitters=false`; test_training,
sparsecore's test_kernels and the pointwise ops: 292 s -> 173 s). XLA:CPU compiles without fast
math and dots and convolutions call the same runtime kernels, so results are those of the default
compilation up to a few ulp in some transcendental functions (measured on 65k normal samples: atan
<= 4 ulp and gelu <= 1e-6 at level 0, tanh <= 6 ulp and log1p <= 1 ulp with the legacy emitters;
exp, log, sin, cos, erf, sigmoid and softmax bit-equal), below every tolerance the tests use against CPU. Benchmarks, the training job and users compile with
XLA's defaults.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable

import torch.multiprocessing as mp

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
    """`XLA_FLAGS` for a test process with `devices` stand-in devices."""
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"


PRELOADED = ("torchtpu", "torch.distributed", "torchrec.distributed.model_parallel", "torchrec_plugin")
"""What the ranks' forkserver imports once, so that each rank starts as a fork of a process that
has it (~1 s) instead of importing torch, JAX and TorchRec anew (~10 s of CPU a rank, with 2-4
ranks starting at once on two cores: 20-50 s a test). None of them starts JAX's runtime, so
every rank still brings its own up, with the environment its entry sets."""


def free_port() -> int:
    """A TCP port free on this host now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(entry: Callable, args: tuple, nprocs: int, timeout: float, what: str) -> None:
    """Run `entry(rank, *args)` in `nprocs` processes, forked by a forkserver that preloaded
    `PRELOADED`; raise with a rank's traceback if one fails, and kill them all at `timeout`.

    A forkserver's children get the environment the server started with, not the caller's
    current one, so `entry` receives this process's environment and restores it first
    (as a spawned process would have it)."""
    mp.set_forkserver_preload(list(PRELOADED))
    context = mp.start_processes(_with_environment, args=(dict(os.environ), entry, args), nprocs=nprocs,
                                 join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"{nprocs} process(es) of {what} did not finish within {timeout} s")


def _with_environment(rank: int, environment: dict[str, str], entry: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    entry(rank, *args)
    # A forked process exits without running atexit, where JAX would leave its multi-process
    # runtime, waiting there for every process. A rank that returns leaves it here instead, so
    # that rank 0, whose coordinator goes with it, cannot exit while another rank is still in a
    # collective (a CI run saw a final gather fail with "Connection reset by peer"). A rank that
    # raised exits at once; the others then fail too, and the first error is reported.
    import jax

    jax.distributed.shutdown()
