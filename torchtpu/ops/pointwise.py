"""Pointwise lowerings: arithmetic, rounding, exponentials and logarithms, trigonometry, fills.

Each op follows its PyTorch CPU kernel's formula where that formula decides edge cases (signed
zeros, NaN, integer rounding and wraparound), so results agree bit for bit where XLA's basic
operations do. Python scalars are traced values (`dynamic_scalars`): a new alpha, weight or
exponent does not recompile.

Integer division by zero cannot raise on the device (PyTorch's CPU kernels raise
`ZeroDivisionError`): it yields XLA's result (-1 for division, the dividend for remainders).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.promotion import BOOL_TO_LONG, COMPLEX_TO_FLOAT, DEFAULT, INT_TO_FLOAT, NO_OPMATH, pointwise
from torchtpu.ops.schema import signature

aten = torch.ops.aten


def _is_integer(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.integer)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _cast(value, like):
    """A Scalar argument (number or traced 0-d array) in the dtype of the tensor `like`."""
    return jnp.asarray(value, like.dtype)


def elementwise(fn: Callable) -> Callable:
    """A lowering body `(ctx, *operands) -> fn(*operands)` for a table of elementwise ops."""

    def lowering(ctx, *operands):
        return fn(*operands)

    lowering.__name__ = lowering.__qualname__ = getattr(fn, "__name__", "elementwise")
    return lowering


def unary(*ops, promotion=INT_TO_FLOAT) -> Callable:
    """Register a lowering of one tensor operand (`self`, or `x` in some `special_*` schemas)."""

    def decorator(fn: Callable) -> Callable:
        for op in ops:
            pointwise(op, promotion=promotion, operands=(signature(op).args[0].name,))(fn)
        return fn

    return decorator


# --- arithmetic ----------------------------------------------------------------------------------


@pointwise(aten.add.Tensor, aten.add.Scalar)
def add(ctx, x, y, alpha=1):
    return x + y * _cast(alpha, y)


@pointwise(aten.sub.Tensor, aten.sub.Scalar)
def sub(ctx, x, y, alpha=1):
    return x - y * _cast(alpha, y)


@pointwise(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(ctx, x, y, alpha=1):
    return y - x * _cast(alpha, x)


@pointwise(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx, x, y):
    return x * y


@pointwise(aten.div.Tensor, aten.div.Scalar, promotion=INT_TO_FLOAT)
def div(ctx, x, y):
    return x / y


@pointwise(aten.div.Tensor_mode, aten.div.Scalar_mode, keep_result_dtype=True)
def div_rounding(ctx, x, y, *, rounding_mode=None):
    """`div(rounding_mode=)`: operands promote as DEFAULT; without a mode the quotient is true
    division in the INT_TO_FLOAT computation dtype (as `torch._refs.div` chooses)."""
    if rounding_mode is None:
        compute, _ = ctx.promotion(INT_TO_FLOAT, "self", "other")
        return x.astype(compute) / y.astype(compute)
    if rounding_mode == "trunc":
        if _is_integer(x):
            return lax.div(*jnp.broadcast_arrays(x, y))
        # PyTorch's vectorized CPU kernel rounds a bf16/f16 quotient to that dtype before trunc.
        return jnp.trunc((x / y).astype(ctx.out_dtype()).astype(x.dtype))
    if rounding_mode == "floor":
        return _floor_divide(x, y)
    raise ValueError(
        f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found {rounding_mode!r}"
    )


@pointwise(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(ctx, x, y):
    return _floor_divide(x, y)


def _floor_divide(x, y):
    x, y = jnp.broadcast_arrays(x, y)
    if _is_integer(x):
        # Truncating quotient, minus one where the signs differ and the division is inexact.
        quotient = lax.div(x, y)
        inexact = lax.rem(x, y) != 0
        signs_differ = (x < 0) != (y < 0)
        return jnp.where(inexact & signs_differ, quotient - 1, quotient)
    # c10's div_floor_floating: exact for quotients that round across an integer.
    mod = lax.rem(x, y)
    quotient = (x - mod) / y
    quotient = jnp.where((mod != 0) & ((y < 0) != (mod < 0)), quotient - 1, quotient)
    floored = jnp.floor(quotient)
    floored = jnp.where(quotient - floored > 0.5, floored + 1, floored)
    floored = jnp.where(quotient == 0, jnp.copysign(jnp.zeros_like(x), x / y), floored)
    return jnp.where(y == 0, x / y, floored)


@pointwise(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(ctx, x, y):
    # Python's modulus: the remainder takes the divisor's sign (jnp.remainder's formula).
    return jnp.remainder(x, y)


@pointwise(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(ctx, x, y):
    # C's fmod: the remainder takes the dividend's sign.
    return lax.rem(*jnp.broadcast_arrays(x, y))


def _check_integer_power(base, exponent) -> None:
    """PyTorch's CPU kernel (not its meta kernel) rejects an integer base to a negative integer
    Scalar power, as NumPy does."""
    if (isinstance(base, torch.Tensor) and not (base.is_floating_point() or base.is_complex())
            and isinstance(exponent, int) and exponent < 0):
        raise RuntimeError("Integers to negative integer powers are not allowed.")


@pointwise(
    aten.pow.Tensor_Tensor,
    aten.pow.Tensor_Scalar,
    aten.pow.Scalar,
    promotion=BOOL_TO_LONG,
    operands=("self", "exponent"),
    validate=_check_integer_power,
)
def power(ctx, base, exponent):
    if _is_integer(base):
        return _integer_pow(base, exponent)
    return jnp.power(base, exponent)


def _integer_pow(base, exponent):
    """Integer power by repeated squaring (wrapping like C++); for a negative exponent, the
    value PyTorch's `powi` gives: 1 for base 1, +-1 for base -1, else 0."""
    base, exponent = jnp.broadcast_arrays(base, exponent)

    def square_and_multiply(_, state):
        result, square, e = state
        result = jnp.where((e & 1) == 1, result * square, result)
        return result, square * square, e >> 1

    bits = jnp.iinfo(exponent.dtype).bits
    one = jnp.ones_like(base)
    result, _, _ = lax.fori_loop(0, bits, square_and_multiply, (one, base, exponent))
    if not jnp.issubdtype(exponent.dtype, jnp.signedinteger):
        return result
    odd = (exponent & 1) == 1
    negative_power = jnp.where(base == 1, one, jnp.where(base == -1, jnp.where(odd, -one, one), 0))
    return jnp.where(exponent < 0, negative_power, result)


@pointwise(aten.addcmul.default, operands=("self", "tensor1", "tensor2"))
def addcmul(ctx, x, t1, t2, *, value=1):
    return x + _cast(value, t1) * t1 * t2


@pointwise(aten.addcdiv.default, promotion=INT_TO_FLOAT, operands=("self", "tensor1", "tensor2"))
def addcdiv(ctx, x, t1, t2, *, value=1):
    return x + _cast(value, t1) * (t1 / t2)


@pointwise(aten.lerp.Scalar, aten.lerp.Tensor, operands=("self", "end", "weight"))
def lerp(ctx, start, end, weight):
    # PyTorch's two-sided formula: exact at both ends (weight 0 and 1).
    weight = _cast(weight, start)
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


# --- sign and rounding ---------------------------------------------------------------------------


@unary(aten.neg.default, promotion=DEFAULT)
def neg(ctx, x):
    return -x


@unary(aten.abs.default, promotion=COMPLEX_TO_FLOAT)
def absolute(ctx, x):
    return x if x.dtype == jnp.bool_ else jnp.abs(x)


@unary(aten.sign.default, aten.sgn.default, promotion=DEFAULT)
def sign(ctx, x):
    if x.dtype == jnp.bool_:
        return x
    if jnp.iscomplexobj(x):
        # sgn: x / |x|, and 0 at 0.
        magnitude = jnp.abs(x)
        return jnp.where(magnitude == 0, jnp.zeros_like(x), x / jnp.where(magnitude == 0, 1, magnitude))
    # (0 < x) - (x < 0): NaN has sign 0, as in PyTorch.
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def _keep_integers(fn: Callable) -> Callable:
    """Rounding of integers (and bools) is the identity."""

    def rounded(x):
        return fn(x) if _is_float(x) else x

    rounded.__name__ = fn.__name__
    return rounded


def _round_half_even(x):
    return lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)


_ROUNDING: dict = {
    aten.floor.default: jnp.floor,
    aten.ceil.default: jnp.ceil,
    aten.trunc.default: jnp.trunc,
    aten.round.default: _round_half_even,
}
for _op, _fn in _ROUNDING.items():
    unary(_op, promotion=DEFAULT)(elementwise(_keep_integers(_fn)))


@unary(aten.round.decimals, promotion=DEFAULT)
def round_decimals(ctx, x, *, decimals):
    if not _is_float(x):
        return x
    scale = jnp.asarray(10.0 ** abs(decimals), x.dtype)
    if decimals < 0:
        return _round_half_even(x / scale) * scale
    return _round_half_even(x * scale) / scale


@unary(aten.frac.default, promotion=DEFAULT)
def frac(ctx, x):
    return x - jnp.trunc(x)


# --- exponentials, logarithms, powers, trigonometry ----------------------------------------------

_FLOAT_UNARY: dict = {
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.reciprocal.default: jnp.reciprocal,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.sigmoid.default: jax.nn.sigmoid,
    aten.deg2rad.default: jnp.deg2rad,
    aten.rad2deg.default: jnp.rad2deg,
}
for _op, _fn in _FLOAT_UNARY.items():
    unary(_op)(elementwise(_fn))


@unary(aten.sinc.default)
def sinc(ctx, x):
    scaled = x * jnp.asarray(np.pi, x.dtype)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(scaled) / scaled)


@pointwise(aten.angle.default, operands=("self",), promotion=INT_TO_FLOAT, keep_result_dtype=True)
def angle(ctx, x):
    if jnp.iscomplexobj(x):
        return jnp.angle(x).astype(ctx.out_dtype())
    # The argument of a real number: pi for negatives, 0 otherwise, NaN kept.
    pi = jnp.asarray(np.pi, x.dtype)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, pi, jnp.zeros_like(x)))


@pointwise(aten.atan2.default, promotion=INT_TO_FLOAT)
def atan2(ctx, y, x):
    return jnp.arctan2(y, x)


@pointwise(aten.hypot.default)
def hypot(ctx, x, y):
    return jnp.hypot(x, y)


@pointwise(aten.copysign.Tensor, aten.copysign.Scalar, promotion=INT_TO_FLOAT)
def copysign(ctx, x, y):
    return jnp.copysign(x, y)


@pointwise(aten.nextafter.default, promotion=NO_OPMATH)
def nextafter(ctx, x, y):
    return jnp.nextafter(x, y)


@pointwise(aten.ldexp.Tensor, promotion=INT_TO_FLOAT)
def ldexp(ctx, x, exponent):
    return x * jnp.power(jnp.asarray(2, x.dtype), exponent)


@pointwise(aten.frexp.Tensor, operands=("self",), keep_result_dtype=True)
def frexp(ctx, x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent.astype(jnp.int32)


@pointwise(aten.logaddexp.default)
def logaddexp(ctx, x, y):
    return _logaddexp(x, y, jnp.exp, jnp.log1p, 1.0)


@pointwise(aten.logaddexp2.default)
def logaddexp2(ctx, x, y):
    return _logaddexp(x, y, jnp.exp2, jnp.log1p, 1 / np.log(2))


def _logaddexp(x, y, exp, log1p, scale):
    """max + log1p(exp(-|x - y|)) * scale; equal infinities give themselves (not NaN)."""
    x, y = jnp.broadcast_arrays(x, y)
    larger = jnp.maximum(x, y)
    result = larger + log1p(exp(-jnp.abs(x - y))) * jnp.asarray(scale, x.dtype)
    return jnp.where(jnp.isinf(x) & (x == y), x, result)


@pointwise(aten.heaviside.default, operands=("self", "values"))
def heaviside(ctx, x, values):
    x, values = jnp.broadcast_arrays(x, values)
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype))


@pointwise(aten.gcd.default)
def gcd(ctx, x, y):
    return _gcd(*jnp.broadcast_arrays(x, y))


def _gcd(x, y):
    """Euclid's algorithm, all elements at once, until every remainder is zero."""

    def step(state):
        a, b = state
        nonzero = a != 0
        return jnp.where(nonzero, lax.rem(b, jnp.where(nonzero, a, 1)), a), jnp.where(nonzero, a, b)

    _, g = lax.while_loop(lambda s: jnp.any(s[0] != 0), step, (jnp.abs(x), jnp.abs(y)))
    return g


@pointwise(aten.lcm.default)
def lcm(ctx, x, y):
    x, y = jnp.broadcast_arrays(x, y)
    g = _gcd(x, y)
    return jnp.where(g == 0, jnp.zeros_like(x), jnp.abs(lax.div(x, jnp.where(g == 0, 1, g)) * y))


@unary(aten.nan_to_num.default, promotion=DEFAULT)
def nan_to_num(ctx, x, nan=None, posinf=None, neginf=None):
    if not _is_float(x):
        return x
    # Defaults are the largest finite values of the output dtype (bf16's, for a bf16 tensor).
    finfo = jnp.finfo(ctx.out_dtype())
    nan = 0.0 if nan is None else nan
    posinf = finfo.max if posinf is None else posinf
    neginf = finfo.min if neginf is None else neginf
    x = jnp.where(jnp.isnan(x), _cast(nan, x), x)
    return jnp.where(jnp.isposinf(x), _cast(posinf, x), jnp.where(jnp.isneginf(x), _cast(neginf, x), x))


# --- fills and copies ----------------------------------------------------------------------------


@registry.register(aten.fill.Scalar, aten.fill.Tensor, dynamic_scalars=True)
def fill(ctx, x, value):
    return jnp.full(x.shape, jnp.asarray(value).astype(ctx.out_dtype()), ctx.out_dtype())


@registry.register(aten.zero.default)
def zero(ctx, x):
    return jnp.zeros(x.shape, ctx.out_dtype())


@registry.register(aten.copy.default)
def copy(ctx, x, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(ctx.out_dtype()), x.shape)


@registry.register(aten._to_copy.default)
def to_copy(ctx, x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
            memory_format=None):
    """`x.to(dtype)` inside a compiled graph (autocast's casts, mixed-precision code): a copy in the
    output's dtype. Copies between devices never reach a program (their host side keeps them out,
    `exec.split`), and eager calls keep PyTorch's composite kernel, which moves between devices."""
    return x.astype(ctx.out_dtype())
