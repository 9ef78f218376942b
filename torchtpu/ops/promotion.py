"""Elementwise type promotion for lowerings, by PyTorch's declared promotion kinds.

A pointwise lowering declares its kind (as `torch._refs` does) and which arguments take part;
the wrapper casts those arguments to the computation dtype, calls the math, and casts the result
to the result dtype. The dtypes themselves come from `torch._prims_common.elementwise_dtypes` on
the call's meta arguments, so PyTorch's rules are never re-derived here. Low-precision floats
compute in float32 ("opmath"), as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax.numpy as jnp
from torch._ops import OpOverload
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind

from torchtpu.ops import registry
from torchtpu.ops.schema import signature

DEFAULT = Kind.DEFAULT
INT_TO_FLOAT = Kind.INT_TO_FLOAT
ALWAYS_BOOL = Kind.ALWAYS_BOOL
COMPLEX_TO_FLOAT = Kind.COMPLEX_TO_FLOAT
BOOL_TO_LONG = Kind.BOOL_TO_LONG
NO_OPMATH = Kind.NO_OPMATH


def pointwise(
    *ops: OpOverload,
    promotion: Kind = DEFAULT,
    operands: Sequence[str] = ("self", "other"),
    dynamic_scalars: bool = True,
    keep_result_dtype: bool = False,
    validate: Callable[..., None] | None = None,
) -> Callable:
    """Register `fn(ctx, *args, **kwargs)` for `ops` with type promotion over `operands`.

    `fn` sees the named operands already cast to the computation dtype; its result is cast to
    the result dtype (unless `keep_result_dtype`, for ops that produce integer indices etc.).
    """

    def decorator(fn: Callable) -> Callable:
        for op in ops:
            names = [n for n in operands if n in signature(op).index]
            positions = {signature(op).index[n]: n for n in names}
            registry.register(op, dynamic_scalars=dynamic_scalars, validate=validate)(
                _promoting(fn, op, names, positions, promotion, keep_result_dtype)
            )
        return fn

    return decorator


def _promoting(fn, op, names, positions, promotion, keep_result_dtype):
    sig = signature(op)
    n_positional = sum(1 for a in sig.args if not a.kwarg_only)

    @functools.wraps(fn)
    def lowering(ctx, *args, **kwargs):
        compute, result = ctx.promotion(promotion, *names)
        args = list(args)
        for index, name in positions.items():
            if index < n_positional:
                if args[index] is not None:
                    args[index] = jnp.asarray(args[index], compute)
            elif kwargs.get(name) is not None:
                kwargs[name] = jnp.asarray(kwargs[name], compute)
        out = fn(ctx, *args, **kwargs)
        if keep_result_dtype:
            return out
        return out.astype(result)

    return lowering


def cast_to(value, dtype):
    """`value` (array or Python number) as an array of `dtype`."""
    return jnp.asarray(value, dtype)
