"""Helion kernels (`@helion.kernel(backend="pallas")`) as JAX functions for the kernel bridge.

Helion compiles a kernel written over torch tensors into a Pallas kernel; `Kernel.jax_fn` calls
it on JAX arrays (tracers included). This module turns such a kernel into a function the bridge
registers like any other: parameters annotated `torch.Tensor` become its positional tensors, the
others (Helion's scalar arguments) keyword-only static values, so `op(x, y, eps=1e-5)` calls
`kernel(x, y, 1e-5)` in the kernel's own parameter order.

Interpret mode is Helion's own setting (`settings.pallas_interpret`): the adapter turns it on
where there is no Mosaic and off on a TPU, resetting the kernel's compiled variants when it
changes. Helion's host-side wrapper builds torch meta tensors, so it runs outside any fake mode
and outside dynamo -- the bridge calls it from the op's fake implementation, which PyTorch may
invoke while tracing.

Helion is an optional dependency (`pip install torchtpu[helion]`); nothing here imports it. On
the CPU stand-in Helion 1.5.1 was run in interpret mode; the Mosaic path (platform "tpu") is
untested.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch


def is_helion_kernel(obj: Any) -> bool:
    """A `helion.Kernel` (recognised without importing helion)."""
    return type(obj).__module__.startswith("helion.") and hasattr(obj, "jax_fn") and hasattr(obj, "settings")


def _is_tensor_parameter(param: inspect.Parameter) -> bool:
    annotation = param.annotation
    return annotation is torch.Tensor or (isinstance(annotation, str) and annotation.endswith("Tensor"))


def set_interpret(kernel: Any, interpret: bool) -> None:
    """Compile `kernel` for Pallas's interpreter (`interpret`) or for Mosaic from now on."""
    if bool(kernel.settings.pallas_interpret) != interpret:
        kernel.settings.pallas_interpret = interpret
        kernel.reset()


def helion_function(kernel: Any, name: str) -> Callable[..., Any]:
    """A JAX function `f(*tensors, **static)` calling the Helion kernel `kernel` (op `name`)."""
    backend = kernel.settings.backend
    if backend != "pallas":
        raise TypeError(
            f"kernel {name}: the Helion kernel {kernel.fn.__name__!r} has backend {backend!r}; "
            f"only backend='pallas' kernels run on tpu"
        )
    params = list(inspect.signature(kernel.fn).parameters.values())
    tensors = [p for p in params if _is_tensor_parameter(p)]
    statics = [p for p in params if not _is_tensor_parameter(p)]
    order = [p.name for p in params]

    @torch._dynamo.disable
    def call(*arrays: Any, **static: Any) -> Any:
        values = {**dict(zip((p.name for p in tensors), arrays)), **static}
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return kernel.jax_fn(*(values[n] for n in order if n in values))

    call.__signature__ = inspect.Signature(
        [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=inspect.Parameter.empty) for p in tensors]
        + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in statics]
    )
    call.__name__ = kernel.fn.__name__
    return call
