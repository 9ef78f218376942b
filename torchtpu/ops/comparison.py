"""Comparisons and selections: eq..ge, equal, logical_*, bitwise_* and shifts, maximum/minimum and their
NaN-ignoring fmax/fmin, clamp, where, and the predicates isnan/isinf/isposinf/isneginf/signbit.

Comparisons promote their operands to a common dtype first (`ALWAYS_BOOL`), so `int_tensor == 2.5`
compares in floating point, as PyTorch does.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.pointwise import elementwise, unary
from torchtpu.ops.promotion import ALWAYS_BOOL, DEFAULT, NO_OPMATH, pointwise

aten = torch.ops.aten


def _binary(ops, fn, promotion) -> None:
    for op in ops:
        pointwise(op, promotion=promotion)(elementwise(fn))


@registry.register_data_dependent(aten.equal.default)
def equal(self: torch.Tensor, other: torch.Tensor) -> bool:
    """`torch.equal`: same shape and equal elements (compared after type promotion, NaN unequal
    to itself). Its result is a Python bool, so it reads one value to the host."""
    if self.shape != other.shape:
        return False
    return bool(torch.eq(self, other).all())


def _overloads(*names: str, kinds=("Tensor", "Scalar")):
    """The overloads `kinds` of each op in `names`, e.g. `aten.eq.Tensor` and `aten.eq.Scalar`."""
    return [getattr(getattr(aten, name), kind) for name in names for kind in kinds]


# --- comparisons and logic -----------------------------------------------------------------------

_COMPARISONS = {
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
}
for _name, _fn in _COMPARISONS.items():
    _binary(_overloads(_name), _fn, ALWAYS_BOOL)


def _truth(x):
    return x if x.dtype == jnp.bool_ else x != 0


_LOGICAL = {
    "logical_and": lambda x, y: _truth(x) & _truth(y),
    "logical_or": lambda x, y: _truth(x) | _truth(y),
    "logical_xor": lambda x, y: _truth(x) ^ _truth(y),
}
for _name, _fn in _LOGICAL.items():
    _binary(_overloads(_name, kinds=("default",)), _fn, ALWAYS_BOOL)


@unary(aten.logical_not.default, promotion=ALWAYS_BOOL)
def logical_not(ctx, x):
    return ~_truth(x)


# --- bits ----------------------------------------------------------------------------------------

_BITWISE = {"bitwise_and": jnp.bitwise_and, "bitwise_or": jnp.bitwise_or, "bitwise_xor": jnp.bitwise_xor}
for _name, _fn in _BITWISE.items():
    _binary(_overloads(_name, kinds=("Tensor", "Scalar", "Scalar_Tensor")), _fn, DEFAULT)


@unary(aten.bitwise_not.default, promotion=DEFAULT)
def bitwise_not(ctx, x):
    return jnp.invert(x)


def _shift_left(x, shift):
    """C++'s unsigned left shift; shifts that are negative or >= the bit width give 0."""
    x, shift = jnp.broadcast_arrays(x, shift)
    bits = jnp.iinfo(x.dtype).bits
    out_of_range = (shift < 0) | (shift >= bits)
    shifted = lax.shift_left(x, jnp.where(out_of_range, 0, shift))
    return jnp.where(out_of_range, jnp.zeros_like(x), shifted)


def _shift_right(x, shift):
    """Arithmetic right shift for signed types (logical for unsigned); shifts that are negative
    or too large fill with the sign bit (zero for unsigned types), as PyTorch's CPU kernel."""
    x, shift = jnp.broadcast_arrays(x, shift)
    signed = jnp.issubdtype(x.dtype, jnp.signedinteger)
    largest = jnp.iinfo(x.dtype).bits - (1 if signed else 0)
    shift = jnp.where((shift < 0) | (shift >= largest), largest, shift)
    if signed:
        return lax.shift_right_arithmetic(x, shift)
    return jnp.where(shift >= largest, jnp.zeros_like(x), lax.shift_right_logical(x, shift))


_SHIFT_OVERLOADS = ("Tensor", "Tensor_Scalar", "Scalar_Tensor")
_binary(_overloads("bitwise_left_shift", kinds=_SHIFT_OVERLOADS), _shift_left, DEFAULT)
_binary(_overloads("bitwise_right_shift", kinds=_SHIFT_OVERLOADS), _shift_right, DEFAULT)
_binary(_overloads("__lshift__"), _shift_left, DEFAULT)
_binary(_overloads("__rshift__"), _shift_right, DEFAULT)


# --- extrema and clamping ------------------------------------------------------------------------

# maximum/minimum propagate NaN; fmax/fmin return the other operand when one is NaN.
_binary([aten.maximum.default], jnp.maximum, DEFAULT)
_binary([aten.minimum.default], jnp.minimum, DEFAULT)
_binary([aten.fmax.default], jnp.fmax, DEFAULT)
_binary([aten.fmin.default], jnp.fmin, DEFAULT)


@pointwise(aten.clamp.default, aten.clamp.Tensor, operands=("self", "min", "max"))
def clamp(ctx, x, lower=None, upper=None):
    # max(x, lower) then min(., upper): a NaN input or bound gives NaN; lower > upper gives upper.
    if lower is not None:
        x = jnp.maximum(x, lower)
    if upper is not None:
        x = jnp.minimum(x, upper)
    return x


@pointwise(aten.clamp_min.default, aten.clamp_min.Tensor, operands=("self", "min"))
def clamp_min(ctx, x, lower):
    return jnp.maximum(x, lower)


@pointwise(aten.clamp_max.default, aten.clamp_max.Tensor, operands=("self", "max"))
def clamp_max(ctx, x, upper):
    return jnp.minimum(x, upper)


@pointwise(aten.where.self, promotion=NO_OPMATH, operands=("self", "other"))
def where(ctx, condition, x, y):
    return jnp.where(_truth(condition), x, y)


# --- predicates ----------------------------------------------------------------------------------


def _float_predicate(fn):
    """`fn` on floating-point tensors; integers and bools are never NaN or infinite."""

    def predicate(x):
        return fn(x) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, jnp.bool_)

    predicate.__name__ = fn.__name__
    return predicate


_PREDICATES = {
    aten.isnan.default: _float_predicate(jnp.isnan),
    aten.isinf.default: _float_predicate(jnp.isinf),
    aten.isposinf.default: _float_predicate(jnp.isposinf),
    aten.isneginf.default: _float_predicate(jnp.isneginf),
}
for _op, _fn in _PREDICATES.items():
    unary(_op, promotion=ALWAYS_BOOL)(elementwise(_fn))


@unary(aten.signbit.default, promotion=ALWAYS_BOOL)
def signbit(ctx, x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.signbit(x)
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        return x < 0
    return jnp.zeros(x.shape, jnp.bool_)
