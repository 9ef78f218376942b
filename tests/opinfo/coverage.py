"""What runs natively on `tpu`: the Core ATen opset's coverage and the lowered ops, by kind.

An ATen overload runs natively when it never needs the CPU fallback:

- lowered: it (or the functional overload of an in-place/`out=` overload) has a lowering in the
  registry, or is registered as a data-dependent-shape op;
- view: it only changes metadata, through the backend's view kernels (`view`, `as_strided`) or
  PyTorch's CompositeExplicitAutograd view kernels that end in them;
- backend kernel: allocation, copies and resizing (`empty`, `copy_`, `resize_`, ...);
- implicit composite: CompositeImplicitAutograd ops decompose before reaching any backend;
- decomposed: the backend runs PyTorch's decomposition of it (`torchtpu.ops.decomps`), whose
  pieces are native if they are themselves;
- explicit composite: no tpu kernel, but a CompositeExplicitAutograd kernel that every backend
  without one runs (`_to_copy`: allocate, then `copy_`), native if the ops it calls are.

The last two kinds are native only as far as what they call is: the OpInfo sweep, run under
`TORCHTPU_STRICT_OPS=1`, is what proves it for the entries that reach them.

The Core ATen opset is every overload tagged `torch.Tag.core`; all of it must run natively.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torchtpu  # noqa: F401  (registers the device and fills the registry)
from torch._ops import OpOverload
from torchtpu.exec import kernels
from torchtpu.ops import decomps, registry

LOWERED = "lowered"
VIEW = "view"
BACKEND_KERNEL = "backend kernel"
IMPLICIT_COMPOSITE = "implicit composite"
DECOMPOSED = "decomposed"
EXPLICIT_COMPOSITE = "explicit composite"


@lru_cache(maxsize=None)
def aten_overloads() -> tuple[OpOverload, ...]:
    """Every ATen overload this torch build defines."""
    out = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        packet = getattr(torch.ops.aten, schema.name.removeprefix("aten::"), None)
        overload = getattr(packet, schema.overload_name or "default", None) if packet else None
        if isinstance(overload, OpOverload):
            out.add(overload)
    return tuple(sorted(out, key=str))


def core_aten_ops() -> tuple[OpOverload, ...]:
    return tuple(op for op in aten_overloads() if torch.Tag.core in op.tags)


def _has_kernel(op: OpOverload, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)


def _is_view(op: OpOverload) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def native_kind(op: OpOverload) -> str | None:
    """How `op` runs natively on `tpu` (one of the kinds above), or None if it would need the
    CPU fallback."""
    if op in registry.data_dependent_ops() or kernels.lowering_for(op) is not None:
        return LOWERED
    if _is_view(op) and (_has_kernel(op, "PrivateUse1") or _has_kernel(op, "CompositeExplicitAutograd")):
        return VIEW
    if _has_kernel(op, "PrivateUse1"):
        return BACKEND_KERNEL
    if _has_kernel(op, "CompositeImplicitAutograd"):
        return IMPLICIT_COMPOSITE
    if decomps.get(op) is not None:
        return DECOMPOSED
    if _has_kernel(op, "CompositeExplicitAutograd"):
        return EXPLICIT_COMPOSITE
    return None


def op_name(op: OpOverload) -> str:
    """The op an overload belongs to, in-place spelling folded in: `add_.Tensor` -> `add`."""
    name = op._schema.name.removeprefix("aten::")
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def lowered_overloads() -> list[OpOverload]:
    """Overloads with a lowering of their own that a `tpu` call can reach (implicit composites
    decompose before the backend, so a lowering of one is never used)."""
    ops = set(registry.lowered_ops()) | set(registry.data_dependent_ops())
    return sorted((op for op in ops if not _has_kernel(op, "CompositeImplicitAutograd")), key=str)
