"""XLA flags of the CPU stand-in for every process the tests start (pytest's own, and the ranks
and jobs they spawn).

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

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
    """`XLA_FLAGS` for a test process with `devices` stand-in devices."""
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"
