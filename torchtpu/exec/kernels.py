"""The PrivateUse1 kernels: how every ATen call on a `tpu` tensor reaches an executor.

- Ops with a lowering (and their in-place / `out=` variants) run through `execute`, which hands
  the call to the current eager executor (strict/debug run it now, defer records it).
- View ops only change metadata: they redispatch to PyTorch's CPU kernels, which set sizes,
  strides and storage offset on a tensor that shares the base's storage.
- Allocation, transfers and resizing have their own kernels (`torchtpu.exec.memory`).
- Everything else reaches the boxed fallback: PyTorch's decomposition if there is one, else the
  CPU fallback -- counted, warned once per op, and an error under `TORCHTPU_STRICT_OPS=1`.
- Sparse layouts (COO, CSR and the other compressed ones) have no tpu kernels: every op that
  reaches a sparse tpu tensor -- making one included, as `nn.Embedding(sparse=True)`'s backward
  does -- raises `SparseLayoutError`, saying what to use instead.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Any

import torch
from torch._ops import OpOverload

from torchtpu import counters
from torchtpu.exec import deferred, eager, fast_dispatch, memory, modes, opcall
from torchtpu.ops import decomps, fbgemm, registry
from torchtpu.ops.schema import functional_variant, signature

aten = torch.ops.aten
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

_impl_libs: dict[str, torch.library.Library] = {}
_fallback_lib = torch.library.Library("_", "IMPL")
_registered: set[OpOverload] = set()


class StrictOpsError(NotImplementedError):
    """An op would run through the CPU fallback while `TORCHTPU_STRICT_OPS=1`."""


@functools.lru_cache(maxsize=None)
def lowering_for(op: OpOverload) -> registry.Lowering | None:
    functional = functional_variant(op)
    return registry.get(functional) if functional is not None else None


_encoders: dict[OpOverload, opcall.Encoder] = {}


def encoder_for(op: OpOverload) -> opcall.Encoder:
    """The op's encoder (which remembers its calls' argument layouts)."""
    encoder = _encoders.get(op)
    if encoder is None:
        lowering = lowering_for(op)
        if lowering is None:
            raise opcall.NoLowering(str(op))
        encoder = _encoders[op] = opcall.Encoder(op, lowering)
    return encoder


def execute(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run (or record) a call of an op that has a lowering."""
    return submit(encoder_for(op).encode(args, kwargs))


def submit(call: opcall.Inputs) -> Any:
    """Hand an encoded call (an op, or a compiled graph) to the current eager executor."""
    if modes.current() == "defer":
        return deferred.record(call)
    return eager.run(call)


def _lowered_kernel(op: OpOverload, noted: bool = False):
    """The Python kernel of an op with a lowering; `noted`: it sits behind the C++ fast path,
    which learns from the calls it runs (`fast_dispatch.note`)."""
    encoder: opcall.Encoder | None = None

    def kernel(*args, **kwargs):
        nonlocal encoder
        if encoder is None:
            encoder = encoder_for(op)
        call = encoder.encode(args, kwargs)
        result = submit(call)
        if noted:
            fast_dispatch.note(op, call)
        return result

    kernel.__name__ = f"tpu_{op.__name__}"
    return kernel


def _view_kernel(op: OpOverload):
    def kernel(*args, **kwargs):
        return op.redispatch(_CPU_KEYS, *args, **kwargs)

    return kernel


def _register(op: OpOverload, kernel, key: str = "PrivateUse1") -> None:
    if op in _registered:
        return
    lib = _impl_libs.get(op.namespace)
    if lib is None:
        lib = _impl_libs[op.namespace] = torch.library.Library(op.namespace, "IMPL")
    lib.impl(op, kernel, key)
    _registered.add(op)


def _register_view(op: OpOverload) -> None:
    """A view op's kernel: PyTorch's CPU kernel, reached from C++ where the fast path is
    installed, else through the Python `_view_kernel`."""
    if op in _registered:
        return
    if fast_dispatch.enabled():
        fast_dispatch.install_view(op)
        _registered.add(op)
    else:
        _register(op, _view_kernel(op))


_FACTORIES = (aten.empty.memory_format, aten.empty_strided.default)


def _register_factories() -> None:
    """The kernels of `torch.empty` and `empty_strided`: C++ where the fast path is installed
    (their Python kernels then serve PrivateUse2, which it hands every call but the plain ones)."""
    if all(op in _registered for op in _FACTORIES):
        return
    fast = fast_dispatch.enabled()
    for op in _FACTORIES:
        _register(op, _MEMORY_KERNELS[op], "PrivateUse2" if fast else "PrivateUse1")
    if fast:
        fast_dispatch.install_factories()


def _register_lowered(op: OpOverload) -> None:
    """The kernel of an op with a lowering: behind the C++ fast path where that reads the op's
    calls (the Python kernel then serves PrivateUse2, which the fast path hands calls to)."""
    if op in _registered:
        return
    if fast_dispatch.enabled() and fast_dispatch.readable(op):
        _register(op, _lowered_kernel(op, noted=True), "PrivateUse2")
        fast_dispatch.install(op, lowering_for(op).dynamic_scalars)
    else:
        _register(op, _lowered_kernel(op))


# --- the fallback -------------------------------------------------------------------------------


def strict_ops() -> bool:
    return os.environ.get("TORCHTPU_STRICT_OPS", "0") not in ("", "0")


class SparseLayoutError(NotImplementedError):
    """An op reached a sparse tpu tensor: the device has dense layouts only."""


def refuse_sparse(op: OpOverload, *args, **kwargs) -> Any:
    """The fallback of the sparse tpu dispatch keys."""
    raise SparseLayoutError(
        f"{op}: sparse tensors are not supported on tpu (the device has dense layouts only). Keep "
        f"sparse tensors on the CPU or make them dense (`.to_dense()`). For embedding tables, use "
        f"sparse=False, or embeddings.SparseCoreEmbeddingBagCollection / SparseCoreEmbeddingCollection, "
        f"whose tables are updated in the backward pass, only in the rows a batch looked up."
    )


_SPARSE_KEYS = ("SparsePrivateUse1", "SparseCsrPrivateUse1")

_warned: set[str] = set()


def fallback(op: OpOverload, *args, **kwargs) -> Any:
    if lowering_for(op) is not None:
        return execute(op, args, kwargs)
    if op.namespace == "fbgemm" and fbgemm.install():
        return op(*args, **kwargs)  # FBGEMM came after torchtpu: the first of its ops installs its tpu kernels
    decomposition = decomps.get(op)
    if decomposition is not None:
        counters.count_op("decomposed_ops", str(op))
        if op in _decomposing.ops:
            raise RuntimeError(
                f"the decomposition of {op} calls {op} again on tpu tensors: it needs a lowering"
            )
        _decomposing.ops.add(op)
        try:
            return decomposition(*args, **kwargs)
        finally:
            _decomposing.ops.discard(op)
    return cpu_fallback(op, args, kwargs)


class _Decomposing(threading.local):
    def __init__(self) -> None:
        self.ops: set[OpOverload] = set()


_decomposing = _Decomposing()


def cpu_fallback(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run `op` on CPU copies of its arguments and copy results (and mutations) back."""
    name = str(op)
    if strict_ops():
        raise StrictOpsError(
            f"{name} has no tpu lowering or decomposition, and TORCHTPU_STRICT_OPS=1 forbids "
            f"running it through the CPU fallback"
        )
    counters.count("cpu_fallback_calls")
    counters.count_op("cpu_fallback_ops", name)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"{name} has no tpu lowering: running it on the CPU (slow: copies to and from the "
            f"host). Set TORCHTPU_STRICT_OPS=1 to make this an error.",
            stacklevel=3,
        )
    device = None
    originals: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []

    def to_cpu(x):
        nonlocal device
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            device = device or x.device
            host = memory.numpy_to_torch(memory.to_numpy(x)).clone()
            originals.append(x)
            copies.append(host)
            return host
        if isinstance(x, torch.device) and x.type == "tpu":
            device = device or x
            return torch.device("cpu")
        if isinstance(x, (list, tuple)):
            return type(x)(to_cpu(v) for v in x)
        return x

    cpu_args = to_cpu(args)
    cpu_kwargs = {k: to_cpu(v) for k, v in kwargs.items()}
    result = op(*cpu_args, **cpu_kwargs)
    # Mutated arguments: write back every tensor the CPU op changed (in place or out=).
    written_names = {op._schema.arguments[i].name for i in signature(op).written}
    by_identity = {id(c): o for o, c in zip(originals, copies)}
    for original, copy in zip(originals, copies):
        if written_names and _is_written(op, args, kwargs, original, written_names):
            if original.shape != copy.shape:
                original.resize_(copy.shape)
            original.copy_(copy)

    def back(x):
        if isinstance(x, torch.Tensor):
            if id(x) in by_identity:
                return by_identity[id(x)]
            return x.to(device) if device is not None else x
        if isinstance(x, (list, tuple)):
            return type(x)(back(v) for v in x)
        return x

    return back(result)


def _is_written(op: OpOverload, args, kwargs, tensor, written_names) -> bool:
    sig = signature(op)
    values = sig.normalize(args, kwargs)
    for arg, value in zip(sig.args, values):
        if arg.name not in written_names:
            continue
        if value is tensor or (isinstance(value, (list, tuple)) and any(v is tensor for v in value)):
            return True
    return False


# --- registration -------------------------------------------------------------------------------

# Views whose PyTorch kernels are per-backend: on tpu they redispatch to the CPU kernels, which
# only set sizes, strides and offset over the shared storage. (Every other view is composite and
# never reaches the backend in eager mode; compiled graphs use the registry's lowerings.)
_VIEW_OPS = (
    aten.view.default,
    aten.as_strided.default,
    aten.as_strided_.default,
    aten._reshape_alias.default,
    aten.unfold.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
)

_MEMORY_KERNELS = {
    aten.empty.memory_format: memory.empty_memory_format,
    aten.empty_strided.default: memory.empty_strided,
    aten.copy_.default: memory.copy_,
    aten._copy_from.default: memory.copy_from,
    aten._copy_from_and_resize.default: memory.copy_from_and_resize,
    aten.resize_.default: memory.resize_,
    aten.set_.source_Storage_storage_offset: memory.set_source_storage_offset,
    aten.set_.source_Storage: memory.set_source_storage,
    aten.set_.source_Tensor: memory.set_source_tensor,
    aten.set_.default: memory.set_empty,
    aten._local_scalar_dense.default: memory.local_scalar_dense,
    aten._has_compatible_shallow_copy_type.default: memory.has_compatible_shallow_copy_type,
    aten.record_stream.default: memory.record_stream,
}


# Lowered for compiled graphs only: eager calls keep PyTorch's composite kernels -- `_to_copy`'s
# also moves tensors between devices (an empty tensor on the target, then `copy_`), and
# `empty_permuted`'s makes its tensor with the factory kernel of `empty_strided`.
_GRAPH_ONLY = frozenset({aten._to_copy.default, aten.empty_permuted.default})


def _variants(op: OpOverload):
    """The in-place and out= overloads (of `op`'s namespace) whose functional variant is `op`."""
    name = op._schema.name.split("::")[1]
    namespace = getattr(torch.ops, op.namespace)
    # `normal_functional` is the functional form of `normal_`.
    for packet_name in (name, name + "_", name.removesuffix("_functional") + "_"):
        packet = getattr(namespace, packet_name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            candidate = getattr(packet, overload)
            if candidate is not op and signature(candidate).written and functional_variant(candidate) is op:
                yield candidate


def _is_composite_implicit(op: OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _returns_alias(op: OpOverload) -> bool:
    """A view: its output aliases an input. In eager mode views only change metadata, so their
    lowerings (which compute a value) must never become their tpu kernels."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def register_all() -> None:
    """Install the PrivateUse1 kernels for every lowered op, the view and memory ops, and the
    fallbacks (the sparse keys' refuses every op). Called once when torchtpu is imported (and
    again after new lowerings register)."""
    for op in _VIEW_OPS:
        _register_view(op)
    _register_factories()
    for op, kernel in _MEMORY_KERNELS.items():
        _register(op, kernel)
    for op, kernel in registry.data_dependent_ops().items():
        _register(op, kernel)
    for op in registry.lowered_ops():
        if op in _MEMORY_KERNELS or op in _GRAPH_ONLY or _is_composite_implicit(op) or _returns_alias(op):
            continue
        _register_lowered(op)
        for variant in _variants(op):
            if variant not in _MEMORY_KERNELS and not _is_composite_implicit(variant):
                _register_lowered(variant)
    if not getattr(register_all, "_fallback_done", False):
        _fallback_lib.fallback(fallback, "PrivateUse1")
        for key in _SPARSE_KEYS:
            _fallback_lib.fallback(refuse_sparse, key)
        register_all._fallback_done = True
