"""Custom kernels: JAX functions (Pallas kernels included) as torch ops on `tpu` tensors.

    @torchtpu.kernels.jax_kernel("mylib::scaled_add")
    def scaled_add(x, y, *, alpha: float = 1.0):
        return x + alpha * y

    out = scaled_add(a, b, alpha=2.0)          # a, b: tpu tensors -> a tpu tensor

The decorator defines a real torch op (`torch.ops.mylib.scaled_add`). Positional parameters are
tensors (they arrive in the function as `jax.Array`s, without a copy); keyword-only parameters
are static Python values (`int`, `float`, `bool`, `str`, or tuples of ints), part of the compile
key. The op's fake (meta) implementation comes from `jax.eval_shape` of the same function, and its
`tpu` implementation is a lowering in the one registry -- so the op runs in strict eager mode,
fuses into the pending graph in defer mode, and compiles inside `torch.compile(backend="tpu")`
graphs. On CPU tensors the function runs through JAX on the host.

`backward="vjp"` registers autograd from `jax.vjp` of the function (as another kernel op, so the
backward runs in every mode too); a callable `backward(primals, cotangents, **static)` returning
one gradient per tensor input (or None) supplies a custom VJP instead.

On a platform without Mosaic (the CPU stand-in), `pallas_call`s inside the function run in
Pallas's TPU interpret mode automatically; on a TPU they compile to Mosaic as written.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from torchtpu import dtypes
from torchtpu.ops import registry

_DEFAULT_NAMESPACE = "tpu_kernels"
_libraries: dict[str, torch.library.Library] = {}

_STATIC_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}


class KernelError(RuntimeError):
    """A kernel's function misbehaved (wrong output count, shape or dtype)."""


def _library(namespace: str) -> torch.library.Library:
    lib = _libraries.get(namespace)
    if lib is None:
        lib = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return lib


def _static_type(param: inspect.Parameter, kernel: str) -> str:
    annotation = param.annotation
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation, annotation)
    if annotation is inspect.Parameter.empty and param.default is not inspect.Parameter.empty:
        annotation = type(param.default)
    if annotation in _STATIC_TYPES:
        return _STATIC_TYPES[annotation]
    if annotation in (tuple, list) or str(annotation).startswith(("tuple[int", "list[int")):
        return "int[]"
    raise TypeError(
        f"kernel {kernel}: static parameter {param.name!r} needs an int, float, bool, str or "
        f"int-tuple annotation or default"
    )


def _schema_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return repr(value).replace("'", '"')
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return repr(value)


@dataclass(frozen=True)
class _Signature:
    tensors: tuple[str, ...]
    statics: tuple[inspect.Parameter, ...]


def _signature(fn: Callable, kernel: str) -> tuple[_Signature, str]:
    params = list(inspect.signature(fn).parameters.values())
    tensors = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    statics = [p for p in params if p.kind is p.KEYWORD_ONLY]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError(f"kernel {kernel}: *args/**kwargs are not supported; name every parameter")
    parts = [f"Tensor {name}" for name in tensors]
    if statics:
        parts.append("*")
        for p in statics:
            entry = f"{_static_type(p, kernel)} {p.name}"
            if p.default is not inspect.Parameter.empty:
                entry += f"={_schema_literal(p.default)}"
            parts.append(entry)
    return _Signature(tuple(tensors), tuple(statics)), ", ".join(parts)


@contextlib.contextmanager
def _pallas_interpret(platform: str):
    """Pallas kernels on a platform without Mosaic run in TPU interpret mode."""
    if platform == "tpu":
        yield
        return
    try:
        from jax.experimental.pallas import tpu as pltpu
    except ImportError:  # Pallas not available: nothing to interpret
        yield
        return
    with pltpu.force_tpu_interpret_mode():
        yield


def _struct(t: torch.Tensor):
    import jax

    return jax.ShapeDtypeStruct(tuple(t.shape), dtypes.to_jax(t.dtype))


class JaxKernel:
    """A JAX function registered as a torch op. Call it like the function, with torch tensors."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        num_outputs: int,
        backward: str | Callable[..., Any] | None,
        out_spec: Callable[..., Any] | None,
    ) -> None:
        namespace, _, op_name = name.rpartition("::")
        self.namespace = namespace or _DEFAULT_NAMESPACE
        self.name = f"{self.namespace}::{op_name}"
        self.fn = fn
        self.num_outputs = num_outputs
        self.out_spec = out_spec
        self.signature, args = _signature(fn, self.name)
        returns = "Tensor" if num_outputs == 1 else "(" + ", ".join(["Tensor"] * num_outputs) + ")"
        lib = _library(self.namespace)
        lib.define(f"{op_name}({args}) -> {returns}")
        self.op = getattr(getattr(torch.ops, self.namespace), op_name).default
        torch.library.register_fake(self.name, self._fake, lib=lib)
        lib.impl(op_name, self._cpu, "CPU")
        registry.register(self.op)(self._lowering)
        from torchtpu.exec import kernels as exec_kernels

        exec_kernels.register_all()
        if backward is not None:
            self._register_backward(backward)

    def __call__(self, *tensors: torch.Tensor, **static: Any) -> Any:
        return self.op(*tensors, **static)

    # -- evaluation ----------------------------------------------------------------------------

    def _evaluate(self, arrays: Sequence[Any], static: dict[str, Any], platform: str):
        with _pallas_interpret(platform):
            out = self.fn(*arrays, **static)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != self.num_outputs:
            raise KernelError(
                f"kernel {self.name} returned {len(outs)} outputs; it was declared with "
                f"num_outputs={self.num_outputs}"
            )
        for i, value in enumerate(outs):
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise KernelError(f"kernel {self.name}: output {i} is a {type(value).__name__}, not an array")
            try:
                dtypes.from_jax(value.dtype)
            except KeyError:
                raise KernelError(
                    f"kernel {self.name}: output {i} has dtype {value.dtype}, which tpu tensors cannot hold"
                ) from None
        if self.out_spec is not None:
            expected = self.out_spec(*arrays, **static)
            expected = tuple(expected) if isinstance(expected, (tuple, list)) else (expected,)
            for i, (value, spec) in enumerate(zip(outs, expected)):
                if tuple(value.shape) != tuple(spec.shape) or value.dtype != spec.dtype:
                    raise KernelError(
                        f"kernel {self.name}: output {i} is {value.dtype}{list(value.shape)} but its "
                        f"out_spec says {spec.dtype}{list(spec.shape)}"
                    )
        return outs

    def _fake(self, *tensors: torch.Tensor, **static: Any):
        import jax

        from torchtpu import runtime

        platform = runtime.runtime().platform
        structs = [_struct(t) for t in tensors]
        outs = jax.eval_shape(lambda *a: self._evaluate(a, static, platform), *structs)
        device = tensors[0].device if tensors else torch.device("meta")
        results = [torch.empty(o.shape, dtype=dtypes.from_jax(o.dtype), device=device) for o in outs]
        return results[0] if self.num_outputs == 1 else tuple(results)

    def _lowering(self, ctx: registry.LoweringContext, *arrays: Any, **static: Any):
        outs = self._evaluate(arrays, static, ctx.platform)
        return outs[0] if self.num_outputs == 1 else outs

    def _cpu(self, *tensors: torch.Tensor, **static: Any):
        import jax
        import jax.numpy as jnp

        from torchtpu.exec import memory

        cpu = jax.devices("cpu")[0]
        arrays = [jax.device_put(jnp.asarray(memory.torch_to_numpy(t)), cpu) for t in tensors]
        outs = jax.jit(lambda *a: self._evaluate(a, static, "cpu"))(*arrays)
        results = [memory.numpy_to_torch(np.asarray(o)) for o in outs]
        return results[0] if self.num_outputs == 1 else tuple(results)

    # -- autograd -------------------------------------------------------------------------------

    def _register_backward(self, backward: str | Callable[..., Any]) -> None:
        n_in, n_out = len(self.signature.tensors), self.num_outputs
        fn = self.fn

        def dense(primals, grads):
            import jax
            import jax.numpy as jnp

            return tuple(
                jnp.zeros_like(p) if g is None or g.dtype == jax.dtypes.float0 else g
                for p, g in zip(primals, grads)
            )

        if backward == "vjp":
            def vjp(*args, **static):
                import jax

                primals, cotangents = args[:n_in], args[n_in:]
                _, pullback = jax.vjp(lambda *p: fn(*p, **static), *primals)
                return dense(primals, pullback(cotangents[0] if n_out == 1 else tuple(cotangents)))
        elif callable(backward):
            def vjp(*args, **static):
                return dense(args[:n_in], backward(args[:n_in], args[n_in:], **static))
        else:
            raise ValueError(f"kernel {self.name}: backward must be 'vjp' or a callable, got {backward!r}")

        vjp.__signature__ = inspect.Signature(
            [inspect.Parameter(f"p{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(n_in)]
            + [inspect.Parameter(f"ct{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(n_out)]
            + list(self.signature.statics)
        )
        op_name = self.name.rpartition("::")[2]
        self.backward_kernel = JaxKernel(vjp, f"{self.namespace}::{op_name}_backward", n_in, None, None)

        def setup_context(ctx, inputs, output, keyword_only_inputs=None):
            ctx.save_for_backward(*inputs)
            outs = output if isinstance(output, tuple) else (output,)
            ctx.outputs = [(o.shape, o.dtype, o.device) for o in outs]
            ctx.static = dict(keyword_only_inputs or {})

        def autograd_backward(ctx, *grads):
            cotangents = [
                torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                for g, (shape, dtype, device) in zip(grads, ctx.outputs)
            ]
            outs = self.backward_kernel(*ctx.saved_tensors, *cotangents, **ctx.static)
            outs = outs if isinstance(outs, tuple) else (outs,)
            needed = ctx.needs_input_grad
            return tuple(g if needed[i] else None for i, g in enumerate(outs))

        torch.library.register_autograd(self.name, autograd_backward, setup_context=setup_context)


def jax_kernel(
    name: str,
    *,
    num_outputs: int = 1,
    backward: str | Callable[..., Any] | None = None,
    out_spec: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], JaxKernel]:
    """Decorator: register a JAX function as the torch op `name` ("namespace::op" or "op")."""

    def decorator(fn: Callable[..., Any]) -> JaxKernel:
        return JaxKernel(fn, name, num_outputs, backward, out_spec)

    return decorator
