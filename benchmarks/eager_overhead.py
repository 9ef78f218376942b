"""Per-op cost of small eager ops on `tpu` next to PyTorch CPU and raw `jax.numpy`, in one run.

    python benchmarks/eager_overhead.py [--iters 2000] [--size 4]

Each op runs `iters` times on the same small inputs (size x size); the device is synchronised
once at the end, so the time per op is the dispatch cost an eager program pays; each cell is the
fastest of `--repeats` interleaved runs, since a shared machine only ever adds time. Rows: PyTorch
CPU eager, raw `jax.numpy` (JAX's own eager dispatch of a cached primitive), torchtpu strict
(one cached XLA program per op, run from the C++ fast path once its layout is known; set
TORCHTPU_FAST_DISPATCH=0 to time the Python path) and torchtpu defer (recording the op; the
fused program runs at the final sync). Goal: strict within 2x of raw JAX dispatch (torchax pays
160-380 us per op). PyTorch runs with one thread (see benchmarks/execution_modes.py for why).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("TORCHTPU_LOCK_DIR", tempfile.mkdtemp(prefix="torchtpu-bench-locks-"))

import torch  # noqa: E402

import torchtpu  # noqa: E402

OPS: dict[str, Callable] = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "matmul": lambda a, b: a @ b,
    "relu": lambda a, b: a.relu() if hasattr(a, "relu") else _jnp().maximum(a, 0),
    "exp": lambda a, b: a.exp() if hasattr(a, "exp") else _jnp().exp(a),
    "sum": lambda a, b: a.sum(),
}


def _jnp():
    import jax.numpy as jnp

    return jnp


def _per_op(fn: Callable, a, b, iters: int, sync: Callable[[object], None]) -> float:
    for _ in range(20):
        out = fn(a, b)
    sync(out)
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(a, b)
    sync(out)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="each cell is the fastest of this many interleaved runs (the machine may be shared)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import jax

    a, b = torch.randn(args.size, args.size), torch.randn(args.size, args.size)
    backends = {
        "torch CPU": (a, b, lambda out: None),
        "raw jax.numpy": (_jnp().asarray(a.numpy()), _jnp().asarray(b.numpy()), jax.block_until_ready),
        "tpu strict": (a.to("tpu"), b.to("tpu"), lambda out: out.cpu()),
        "tpu defer": (a.to("tpu"), b.to("tpu"), lambda out: out.cpu()),
    }
    print(f"{'op':8}" + "".join(f"{name:>16}" for name in backends) + f"{'strict/jax':>12}")
    for op, fn in OPS.items():
        costs = {name: float("inf") for name in backends}
        for _ in range(args.repeats):
            for name, (x, y, sync) in backends.items():
                with torchtpu.eager_mode("defer" if name == "tpu defer" else "strict"):
                    costs[name] = min(costs[name], _per_op(fn, x, y, args.iters, sync))
        row = "".join(f"{costs[name] * 1e6:13.1f} us" for name in backends)
        print(f"{op:8}{row}{costs['tpu strict'] / costs['raw jax.numpy']:12.2f}")
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
