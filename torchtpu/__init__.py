"""torchtpu: PyTorch on Google TPUs, through PJRT/XLA (JAX is the runtime).

`import torchtpu` (or just `import torch`, through the `torch.backends` entry point) registers
the `tpu` device, the `torch.tpu` module and the `tpu_dist` process-group backend.
"""

from __future__ import annotations

from torchtpu import native as _native

_native.prebuild()  # a machine's first import compiles the C++ pieces side by side

from torchtpu import device as _device  # noqa: E402
from torchtpu import counters as _counters  # noqa: E402
from torchtpu.exec import modes as _modes  # noqa: E402
from torchtpu.precision import precision as matmul_precision  # noqa: E402
from torchtpu.precision import set_mode as set_matmul_precision  # noqa: E402

_device.register_backend()

from torchtpu.ops import lowerings as _lowerings  # noqa: E402  (fills the registry)
from torchtpu.exec import kernels as _kernels  # noqa: E402

_kernels.register_all()

from torchtpu import serialization as _serialization  # noqa: E402
from torchtpu import kernels  # noqa: E402,F401  (torchtpu.kernels.jax_kernel)

_serialization.register()

from torchtpu import distributed as _distributed  # noqa: E402,F401  (registers tpu_dist)
from torchtpu import inductor as _inductor  # noqa: E402

_inductor.install()  # torch.compile's default backend on tpu tensors: a clear error

from torchtpu.bounds import Buckets, bounded  # noqa: E402

set_eager_mode = _modes.set_mode
eager_mode = _modes.eager_mode
get_eager_mode = _modes.current


def metrics() -> dict:
    """Counters of the executors: programs compiled, cache hits, fallbacks, flushes, ..."""
    return _counters.snapshot()


def reset_metrics() -> None:
    _counters.reset()


def clear_caches() -> None:
    """Drop every compiled program the executors hold -- strict per-op programs, fused defer
    programs, strided-read programs -- and JAX's own caches, freeing their memory; later calls
    compile again. Programs of live `torch.compile` graphs stay with those graphs."""
    import jax

    from torchtpu.exec import deferred, eager, memory

    eager.clear_cache()
    deferred.clear_cache()
    memory.clear_cache()
    jax.clear_caches()


__all__ = [
    "set_eager_mode",
    "eager_mode",
    "get_eager_mode",
    "set_matmul_precision",
    "matmul_precision",
    "metrics",
    "reset_metrics",
    "clear_caches",
    "bounded",
    "Buckets",
]
