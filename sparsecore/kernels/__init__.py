"""Device-side SparseCore kernels: the lookup and the fused gradient + optimizer update, per device.

Both run inside `shard_map` over a 1-D device mesh. `local_kernels(platform)` picks their
implementation: on "tpu" the libtpu custom calls (`sparsecore.kernels.tpu`, written to the
custom-call contract but untested: no TPU here), on every other platform the XLA stand-in
(`lookup`, `grad_update`) that computes the same thing with ordinary ops and real collectives --
except that on "cpu" the owner's arithmetic of the lookup is a C++ custom call (`cpu`). The
`lookup_impl` argument overrides the lookup: "xla" (the XLA stand-in, on any platform) or
"pallas" (the Pallas embedding bag, `pallas_lookup`: Mosaic on "tpu", Pallas's interpreter
elsewhere).
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Literal, NamedTuple

import jax

from sparsecore.kernels.geometry import KernelGeometry
from sparsecore.kernels.grad_update import update_local, workspace_rows
from sparsecore.kernels.lookup import feature_activations, lookup_local


class LocalKernels(NamedTuple):
    """Per-device lookup and update functions with the signatures of `lookup.lookup_local` and
    `grad_update.update_local`."""

    lookup: Callable
    update: Callable
    lookup_check_vma: bool = True
    """Whether the `shard_map` around the lookup type-checks varying mesh axes. Off for the Pallas
    lookup in interpret mode: Pallas's interpreter (jax 0.10.2) evaluates index maps that mix
    per-device scalars with grid indices without the casts that check requires."""
    lookup_features: Callable | None = None
    """The lookup as `lookup_by_feature` returns it, for a kernel that writes each feature's
    activations into an output of its own; None: `lookup_by_feature` slices them out of `lookup`'s."""

    def lookup_by_feature(
        self, *operands: jax.Array, geometry: KernelGeometry, axis_name: str
    ) -> tuple[jax.Array, ...]:
        """One device's lookup (`lookup`'s arguments) as each feature's activations `[S * samples,
        dim]`: its block of the stack's (`geometry.features`, in that order)."""
        if self.lookup_features is not None:
            return self.lookup_features(*operands, geometry=geometry, axis_name=axis_name)
        return feature_activations(self.lookup(*operands, geometry=geometry, axis_name=axis_name), geometry)


LOOKUP_IMPLS = ("platform", "xla", "pallas")


def local_kernels(platform: str, lookup_impl: Literal["platform", "xla", "pallas"] = "platform") -> LocalKernels:
    """The kernels for devices of `platform` ("tpu" selects the custom calls). `lookup_impl`
    picks the lookup: "platform" (the platform's own: libtpu's on "tpu", the C++ custom call on
    "cpu", the XLA stand-in elsewhere), "xla" (the XLA stand-in) or "pallas" (the Pallas
    embedding bag). Where the C++ lookup cannot be built (no compiler), "cpu" warns and takes
    the XLA stand-in, which computes the same activations, only slower."""
    if lookup_impl not in LOOKUP_IMPLS:
        raise ValueError(f"lookup_impl must be one of {LOOKUP_IMPLS}, got {lookup_impl!r}")
    if platform == "tpu":
        from sparsecore.kernels import tpu

        kernels = LocalKernels(tpu.lookup_local, tpu.update_local)
    else:
        kernels = _cpu_kernels() if platform == "cpu" else LocalKernels(lookup_local, update_local)
    if lookup_impl == "xla":
        kernels = LocalKernels(lookup_local, kernels.update)
    elif lookup_impl == "pallas":
        from sparsecore.kernels import pallas_lookup

        interpret = platform != "tpu"
        lookup = functools.partial(pallas_lookup.lookup_local, interpret=interpret)
        kernels = LocalKernels(lookup, kernels.update, lookup_check_vma=not interpret)
    return kernels


@functools.cache
def _cpu_kernels() -> LocalKernels:
    """The CPU stand-in's kernels, with its C++ lookup built on first use; with the XLA
    stand-in's lookup where the C++ cannot be built (and a warning saying why)."""
    from sparsecore.kernels import cpu, native

    try:
        native.register(*cpu.EMBEDDING_BAG)
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"sparsecore: the CPU lookup kernel could not be built ({error}); lookups run on the "
            "slower XLA stand-in (same results)",
            RuntimeWarning,
            stacklevel=3,
        )
        return LocalKernels(lookup_local, update_local)
    return LocalKernels(cpu.lookup_local, update_local, lookup_features=cpu.lookup_features)


__all__ = ["KernelGeometry", "LocalKernels", "local_kernels", "workspace_rows"]
