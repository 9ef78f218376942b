"""The one table of ATen -> XLA lowerings, shared by every executor.

A lowering is a function `fn(ctx, *args, **kwargs)` over JAX values for one functional ATen
overload: tensors arrive as `jax.Array`s holding their logical values (whatever their strides),
Scalars as numbers or traced 0-d arrays, everything else as the Python values of the schema.
It returns the op's outputs as arrays. It never deals with storage, views, devices, in-place
writes or `out=` arguments: the executors do, the same way for every op.

Shape and dtype rules are not the lowering's business either: the executors know the output
metadata before they lower (from PyTorch's own meta kernels), and hand it over in `ctx`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch._ops import OpOverload
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from torchtpu import dtypes


@dataclass(frozen=True)
class Lowering:
    op: OpOverload
    fn: Callable[..., Any]
    # Scalar arguments are traced inputs (changing them does not recompile). Only for ops whose
    # output metadata cannot depend on a Scalar's value (pointwise math, fills, optimizers).
    dynamic_scalars: bool = False
    # The op draws random numbers (`ctx.rng_key()`).
    random: bool = False
    # Checks of argument values PyTorch makes in its CPU kernel but not its meta kernel:
    # `validate(*args, **kwargs)` gets tensors as meta tensors and Scalars as values, and raises
    # PyTorch's error. The executors run it whenever a call's Scalars are unlike earlier ones.
    validate: Callable[..., None] | None = None
    # Output metadata where PyTorch's meta kernel disagrees with its CPU kernel: called like the
    # op on meta tensors instead of it.
    meta: Callable[..., Any] | None = None


_LOWERINGS: dict[OpOverload, Lowering] = {}


def register(*ops: OpOverload, dynamic_scalars: bool = False, random: bool = False,
             validate: Callable[..., None] | None = None, meta: Callable[..., Any] | None = None):
    """Decorator: `fn` lowers each of `ops` (functional overloads only)."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if not isinstance(op, OpOverload):
                raise TypeError(f"register() takes OpOverloads, got {op!r}")
            if op in _LOWERINGS:
                raise ValueError(f"{op} already has a lowering ({_LOWERINGS[op].fn.__qualname__})")
            _LOWERINGS[op] = Lowering(op, fn, dynamic_scalars, random, validate, meta)
        return fn

    return decorator


_DATA_DEPENDENT: dict[OpOverload, Callable[..., Any]] = {}


def register_data_dependent(*ops: OpOverload):
    """Decorator for ops whose output shape depends on values (`nonzero`, `unique`, boolean
    masks): `fn(*args, **kwargs)` takes and returns `tpu` torch tensors, reads the size it needs
    to the host (one sync), and finishes with ops of static shape, e.g. `nonzero_static`.

    The eager executors call `fn`. An op may also have a lowering (e.g. `index.Tensor`, whose
    integer-index form has a static shape): compiled graphs, where values are never data
    dependent, use that."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if op in _DATA_DEPENDENT:
                raise ValueError(f"{op} already has a data-dependent kernel ({_DATA_DEPENDENT[op].__qualname__})")
            _DATA_DEPENDENT[op] = fn
        return fn

    return decorator


def data_dependent_ops() -> dict[OpOverload, Callable[..., Any]]:
    return dict(_DATA_DEPENDENT)


class ComplexNotSupported(TypeError):
    """A complex tensor reached a lowering not verified for complex dtypes."""


_COMPLEX: set[OpOverload] = set()


def allow_complex(*ops: OpOverload) -> None:
    """Declare that the lowerings of `ops` compute PyTorch's complex results (checked against
    CPU in the tests); any other lowering refuses complex tensors (`check_complex`)."""
    for op in ops:
        if not isinstance(op, OpOverload):
            raise TypeError(f"allow_complex() takes OpOverloads, got {op!r}")
        _COMPLEX.add(op)


def check_complex(op: OpOverload, meta_args: Sequence[Any], meta_out: Any) -> None:
    """Raise `ComplexNotSupported`, naming the op and dtype, if a complex tensor is among the
    call's arguments or outputs and `op`'s lowering is not declared complex-capable: jnp accepts
    complex numbers in many functions whose meaning for them differs from PyTorch's (ordering,
    rounding), so an unverified lowering must not run on them."""
    if op in _COMPLEX:
        return
    for value in _tensors(meta_args, meta_out):
        if value.dtype.is_complex:
            raise ComplexNotSupported(f"{op} does not support {value.dtype} tensors on tpu")


def _tensors(*values: Any):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(*value)


def get(op: OpOverload) -> Lowering | None:
    return _LOWERINGS.get(op)


def lowered_ops() -> frozenset[OpOverload]:
    return frozenset(_LOWERINGS)


@dataclass
class LoweringContext:
    """What a lowering may know besides its argument values.

    `meta_args` are the op's arguments in schema order with every tensor replaced by a meta (or
    fake) tensor of the same metadata; `meta_out` is the op's output metadata in the same form.
    """

    op: OpOverload
    meta_args: Sequence[Any]
    meta_out: Any
    precision: str = "default"
    platform: str = "cpu"
    _rng: Any = None
    _rng_draws: int = field(default=0)
    checks: list = field(default_factory=list)

    def out(self, index: int = 0) -> torch.Tensor:
        """Output `index`'s metadata (a meta tensor)."""
        out = self.meta_out
        if isinstance(out, (tuple, list)):
            return out[index]
        if index != 0:
            raise IndexError(f"{self.op} has one output")
        return out

    def out_dtype(self, index: int = 0):
        return dtypes.to_jax(self.out(index).dtype)

    def out_shape(self, index: int = 0) -> tuple[int, ...]:
        return tuple(self.out(index).shape)

    def arg(self, name_or_index: str | int) -> Any:
        if isinstance(name_or_index, int):
            return self.meta_args[name_or_index]
        from torchtpu.ops.schema import signature

        return self.meta_args[signature(self.op).index[name_or_index]]

    def promotion(
        self, kind: ELEMENTWISE_TYPE_PROMOTION_KIND, *names: str | int
    ) -> tuple[Any, Any]:
        """(computation dtype, result dtype) of PyTorch's elementwise type promotion."""
        operands = [self.arg(n) for n in names]
        operands = [o for o in operands if o is not None]
        compute, result = elementwise_dtypes(*operands, type_promotion_kind=kind)
        return dtypes.to_jax(compute), dtypes.to_jax(result)

    def check(self, ok, message: str) -> None:
        """State that `ok` (a boolean array) must hold everywhere; otherwise a `DeviceCheckError`
        with `message` is raised at the next synchronisation (see `torchtpu.exec.checks`)."""
        import jax.numpy as jnp

        self.checks.append((jnp.all(ok), f"{self.op}: {message}"))

    def rng_key(self):
        """A fresh PRNG key for this op (deterministic: the executor derives it from the
        device generator's seed and offset)."""
        if self._rng is None:
            raise RuntimeError(f"{self.op}: lowering asks for random numbers but is not marked random")
        import jax

        self._rng_draws += 1
        return jax.random.fold_in(self._rng, self._rng_draws)
