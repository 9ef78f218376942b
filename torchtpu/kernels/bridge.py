"""The bridge: a JAX function (or a Helion kernel) registered as a torch op that runs on `tpu`.

`JaxKernel` defines the op from the function's signature (`torchtpu.kernels.schema`), its fake
implementation from `jax.eval_shape` of the function, its `tpu` implementation as a lowering in
the one registry (so every executor -- strict, defer, compiled graphs -- traces the function into
its program, the tensors arriving as the program's `jax.Array`s), a CPU implementation through
JAX on the host, and optionally autograd through a second kernel op computing the VJP. A kernel
whose outputs are new values of some of its inputs (an optimizer's table and slots) also gets an
in-place form, `<op>_`, that writes them into those inputs: the executors donate their buffers,
so the update happens where they are, without a copy.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from torchtpu import dtypes
from torchtpu.kernels import helion_kernels
from torchtpu.kernels.schema import kernel_signature
from torchtpu.ops import registry

_DEFAULT_NAMESPACE = "tpu_kernels"
_libraries: dict[str, torch.library.Library] = {}


class KernelError(RuntimeError):
    """A kernel's outputs break its declaration (wrong count, shape or dtype)."""


def _library(namespace: str) -> torch.library.Library:
    lib = _libraries.get(namespace)
    if lib is None:
        lib = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return lib


@contextlib.contextmanager
def pallas_interpret(platform: str):
    """THE PLATFORM SWITCH for Pallas kernels in plain JAX functions: on a platform without Mosaic
    every `pallas_call` runs in Pallas's TPU interpret mode; on "tpu" it compiles to Mosaic."""
    if platform == "tpu":
        yield
        return
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        yield


def _struct(t: torch.Tensor):
    import jax

    return jax.ShapeDtypeStruct(tuple(t.shape), dtypes.to_jax(t.dtype))


def _describe(value: Any) -> str:
    return f"{value.dtype}{list(value.shape)}"


@contextlib.contextmanager
def _helion_interpret(kernel: Any, platform: str):
    """The platform switch for a Helion kernel: its own interpret setting, and `pallas_interpret`
    for whatever else the function calls (its backward, say)."""
    helion_kernels.set_interpret(kernel, platform != "tpu")
    with pallas_interpret(platform):
        yield


class JaxKernel:
    """A JAX function registered as the torch op `name`. Call it like the function, with torch
    tensors (positional) and static values (keyword-only).

    `fn` may also be a Helion kernel with the Pallas backend (`torchtpu.kernels.helion_kernels`).
    `out_spec(*arrays, **static)`, if given, returns the `jax.ShapeDtypeStruct`(s) the outputs
    must match: a kernel that disagrees raises a `KernelError` naming it. `mutates` names, in
    output order, the tensor parameters the outputs are new values of: `inplace(...)` (the op
    `<name>_`) then writes them there instead of returning them.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        num_outputs: int,
        backward: str | Callable[..., Any] | None,
        out_spec: Callable[..., Any] | None,
        interpret: Callable[[str], ContextManager[None]] = pallas_interpret,
        mutates: Sequence[str] = (),
    ) -> None:
        namespace, _, op_name = name.rpartition("::")
        self.namespace = namespace or _DEFAULT_NAMESPACE
        self.name = f"{self.namespace}::{op_name}"
        self._interpret = interpret
        """The platform switch the function is traced under (`pallas_interpret` by default)."""
        if helion_kernels.is_helion_kernel(fn):
            helion_kernel = fn
            fn = helion_kernels.helion_function(helion_kernel, self.name)
            self._interpret = lambda platform: _helion_interpret(helion_kernel, platform)
        self.fn = fn
        self.num_outputs = num_outputs
        self.out_spec = out_spec
        self.signature = kernel_signature(fn, self.name)
        returns = "Tensor" if num_outputs == 1 else "(" + ", ".join(["Tensor"] * num_outputs) + ")"
        lib = _library(self.namespace)
        lib.define(f"{op_name}({self.signature.schema_args}) -> {returns}")
        self.op = getattr(getattr(torch.ops, self.namespace), op_name).default
        torch.library.register_fake(self.name, self._fake, lib=lib)
        lib.impl(op_name, self._cpu, "CPU")
        registry.register(self.op)(self._lowering)
        self.inplace_op = self._define_inplace(lib, op_name, tuple(mutates)) if mutates else None
        from torchtpu.exec import kernels as exec_kernels

        exec_kernels.register_all()
        if backward is not None:
            self._register_backward(backward)

    def __call__(self, *tensors: torch.Tensor, **static: Any) -> Any:
        return self.op(*tensors, **static)

    def inplace(self, *tensors: torch.Tensor, **static: Any) -> None:
        """The in-place form: the outputs are written into the `mutates` tensors."""
        if self.inplace_op is None:
            raise TypeError(f"kernel {self.name} declares no mutated inputs (jax_kernel(..., mutates=...))")
        self.inplace_op(*tensors, **static)

    _traced_by_dynamo = False

    @classmethod
    def trace_calls_under_dynamo(cls) -> None:
        """Let dynamo trace into kernel calls while it skips torchtpu's frames (which
        `torchtpu.exec.compile` makes it do): a call only runs the op, which must land in the
        traced graph instead of breaking it. Applied by that module rather than here, because
        `import torch` imports this one (the `torch.backends` entry point) and importing dynamo
        costs seconds."""
        if cls._traced_by_dynamo:
            return
        cls.__call__ = torch._dynamo.dont_skip_tracing(cls.__call__)
        cls.inplace = torch._dynamo.dont_skip_tracing(cls.inplace)
        cls._traced_by_dynamo = True

    def _define_inplace(self, lib: torch.library.Library, op_name: str, mutates: tuple[str, ...]):
        """Define `<op_name>_`, writing the outputs into the tensors `mutates` names. Its tpu kernel
        is the executors' in-place path over this op's lowering (`functional_variant`)."""
        unknown = [name for name in mutates if name not in self.signature.tensors]
        if unknown or len(mutates) != self.num_outputs or len(set(mutates)) != len(mutates):
            raise ValueError(
                f"kernel {self.name}: mutates={mutates} must name {self.num_outputs} distinct tensor "
                f"parameters of {self.signature.tensors}, one per output"
            )
        lib.define(f"{op_name}_({self.signature.inplace_schema_args(mutates)}) -> ()")
        positions = [self.signature.tensors.index(name) for name in mutates]

        def fake(*tensors: torch.Tensor, **static: Any) -> None:
            return None

        def cpu(*tensors: torch.Tensor, **static: Any) -> None:
            outs = self._cpu(*tensors, **static)
            for position, value in zip(positions, outs if self.num_outputs > 1 else (outs,)):
                tensors[position].copy_(value)

        torch.library.register_fake(f"{self.name}_", fake, lib=lib)
        lib.impl(f"{op_name}_", cpu, "CPU")
        return getattr(getattr(torch.ops, self.namespace), f"{op_name}_").default

    # -- evaluation ----------------------------------------------------------------------------

    def _evaluate(self, arrays: Sequence[Any], static: dict[str, Any], platform: str) -> tuple[Any, ...]:
        """Trace the function on `arrays` and check its outputs. A function that raises keeps its
        exception (a kernel's own input errors stay what they are), noted with the kernel's name;
        outputs that break the declaration raise `KernelError`."""
        try:
            with self._interpret(platform):
                out = self.fn(*arrays, **static)
        except Exception as error:
            inputs = ", ".join(_describe(a) for a in arrays)
            error.add_note(f"in kernel {self.name}, traced on inputs ({inputs})")
            raise
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
                        f"kernel {self.name}: output {i} is {_describe(value)} but its out_spec "
                        f"says {_describe(spec)}"
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
        for i, value in enumerate(outs):
            if tuple(value.shape) != ctx.out_shape(i) or value.dtype != ctx.out_dtype(i):
                raise KernelError(
                    f"kernel {self.name}: output {i} is {_describe(value)} when traced on "
                    f"{ctx.platform}, but its shape inference gave {ctx.out_dtype(i)}{list(ctx.out_shape(i))}"
                )
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
        self.backward_kernel = JaxKernel(
            vjp, f"{self.namespace}::{op_name}_backward", n_in, None, None, interpret=self._interpret
        )

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
    mutates: Sequence[str] = (),
) -> Callable[[Callable[..., Any]], JaxKernel]:
    """Decorator: register a JAX function as the torch op `name` ("namespace::op" or "op")."""

    def decorator(fn: Callable[..., Any]) -> JaxKernel:
        return JaxKernel(fn, name, num_outputs, backward, out_spec, mutates=mutates)

    return decorator
