"""XLA flags of the CPU stand-in for every process the tests start (pytest's own, and the ranks
and jobs they spawn).

The tests compile thousands of small programs and run each a few times, so most of their time
went to XLA:CPU's LLVM optimisation passes. They compile at optimisation level 0, which halves
the suite. The arithmetic is the same at every level -- XLA:CPU compiles without fast math, and
dots and convolutions call the same runtime kernels -- so results do not change; benchmarks, the
training job and users compile at XLA's default level.
"""

from __future__ import annotations

COMPILE_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """`XLA_FLAGS` for a test process with `devices` stand-in devices."""
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"
