"""Device-side SparseCore kernels: the lookup and the fused gradient + optimizer update, per device.

Both run inside `shard_map` over a 1-D device mesh. `local_kernels(platform)` picks their
implementation: on "tpu" the libtpu custom calls (`sparsecore.kernels.tpu`, written to the
custom-call contract but untested: no TPU here), on every other platform the XLA stand-in
(`lookup`, `grad_update`) that computes the same thing with ordinary ops and real collectives.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from sparsecore.kernels.geometry import KernelGeometry
from sparsecore.kernels.grad_update import update_local, workspace_rows
from sparsecore.kernels.lookup import lookup_local


class LocalKernels(NamedTuple):
    """Per-device lookup and update functions with the signatures of `lookup.lookup_local` and
    `grad_update.update_local`."""

    lookup: Callable
    update: Callable


def local_kernels(platform: str) -> LocalKernels:
    """The kernels for devices of `platform` ("tpu" selects the custom calls)."""
    if platform == "tpu":
        from sparsecore.kernels import tpu

        return LocalKernels(tpu.lookup_local, tpu.update_local)
    return LocalKernels(lookup_local, update_local)


__all__ = ["KernelGeometry", "LocalKernels", "local_kernels", "workspace_rows"]
