"""Special functions: error and gamma families, Hurwitz zeta, Bessel functions, logit, xlogy.

Where `jax.scipy.special` agrees with PyTorch (checked against PyTorch CPU in
tests/torchtpu/ops/test_special.py) it is used; elsewhere the functions are computed here from
their textbook definitions, in the input's own precision (there is no float64 on a TPU):

- the Hurwitz zeta function (and so polygamma) by Euler-Maclaurin summation, which, unlike jax's,
  covers negative non-integer `q` for integer `s`, as PyTorch (Cephes) does;
- Bessel functions J and Y of orders 0 and 1, K of orders 0 and 1, and Airy's Ai, in
  `torchtpu.ops.bessel`; the orthogonal polynomials in `torchtpu.ops.polynomials` (both
  registered by importing them here).

Edge cases (poles, zeros, infinities) follow PyTorch's CPU kernels.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import torch
from jax import lax

from torchtpu.ops import bessel, polynomials  # noqa: F401  (register their functions)
from torchtpu.ops.pointwise import elementwise, unary
from torchtpu.ops.promotion import INT_TO_FLOAT, pointwise

aten = torch.ops.aten


def _erfcx(x):
    """Scaled complementary error function. Below float64, exp(x^2) erfc(x) underflows for
    x > ~9: there the asymptotic series (1 / (x sqrt(pi))) sum (-1)^k (2k-1)!! / (2x^2)^k takes
    over (its eighth term is below float32's epsilon from x = 8)."""
    if x.dtype == jnp.float64:
        return jss.erfcx(x)
    large = x > 8
    safe = jnp.where(large, x, 8.0)
    inverse_2x2 = 1 / (2 * safe * safe)
    term, series = jnp.ones_like(x), jnp.ones_like(x)
    for k in range(1, 8):
        term = -term * (2 * k - 1) * inverse_2x2
        series = series + term
    asymptotic = series / (safe * np.sqrt(np.pi).astype(x.dtype))
    return jnp.where(large, asymptotic, jss.erfcx(jnp.where(large, 0.0, x)))


def _log_ndtr(x):
    """log Phi(x) as PyTorch computes it: through erfcx below -1 (no underflow), log1p above
    (no rounding of Phi(x) to 1)."""
    t = x * np.sqrt(0.5).astype(x.dtype)
    lower = x < -1
    below = jnp.log(_erfcx(jnp.where(lower, -t, 0)) / 2) - t * t
    return jnp.where(lower, below, jnp.log1p(-lax.erfc(jnp.where(lower, 0, t)) / 2))


def _digamma(x):
    # psi(+-0) = -+inf (the sign of the pole's side), as PyTorch; negative integers give NaN.
    return jnp.where(x == 0, jnp.copysign(jnp.full_like(x, jnp.inf), -x), lax.digamma(x))


def _spherical_bessel_j0(x):
    # sin(x) / x, with its Taylor series near 0 where the quotient loses precision.
    x2 = x * x
    series = 1 - x2 / 6 * (1 - x2 / 20 * (1 - x2 / 42 * (1 - x2 / 72 * (1 - x2 / 110))))
    small = jnp.abs(x) < 0.5
    quotient = jnp.sin(x) / jnp.where(small, 1.0, x)
    return jnp.where(jnp.isinf(x), jnp.zeros_like(x), jnp.where(small, series, quotient))


_FLOAT_UNARY: dict = {
    aten.erf.default: lax.erf,
    aten.erfc.default: lax.erfc,
    aten.erfinv.default: lax.erf_inv,
    aten.lgamma.default: lax.lgamma,
    aten.digamma.default: _digamma,
    aten.i0.default: jss.i0,
    aten.special_i0e.default: jss.i0e,
    aten.special_i1.default: jss.i1,
    aten.special_i1e.default: jss.i1e,
    aten.special_modified_bessel_i0.default: jss.i0,
    aten.special_modified_bessel_i1.default: jss.i1,
    aten.special_ndtri.default: jss.ndtri,
    aten.special_log_ndtr.default: _log_ndtr,
    aten.special_erfcx.default: _erfcx,
    aten.special_entr.default: jss.entr,
    aten.special_spherical_bessel_j0.default: _spherical_bessel_j0,
}
for _op, _fn in _FLOAT_UNARY.items():
    unary(_op)(elementwise(_fn))


@unary(aten.logit.default)
def logit(ctx, x, eps=None):
    if eps is not None:
        # A negative eps means no clamping, as in PyTorch's kernel.
        eps = jnp.asarray(eps, x.dtype)
        x = jnp.where(eps < 0, x, jnp.clip(x, eps, 1 - eps))
    return jnp.log(x / (1 - x))


# --- x * log(y) ------------------------------------------------------------------------------------


def _x_times(log):
    """x * log(y), 0 where x == 0 (even for y == 0), NaN wherever y is NaN."""

    def product(x, y):
        x, y = jnp.broadcast_arrays(x, y)
        value = x * log(y)
        return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(value), value))

    product.__name__ = f"x_times_{log.__name__}"
    return product


for _ops, _log in (
    ((aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other), jnp.log),
    (
        (aten.special_xlog1py.default, aten.special_xlog1py.self_scalar, aten.special_xlog1py.other_scalar),
        jnp.log1p,
    ),
):
    for _op in _ops:
        pointwise(_op, promotion=INT_TO_FLOAT)(elementwise(_x_times(_log)))


# --- incomplete gamma ------------------------------------------------------------------------------


def _incomplete_gamma(a, x, regularized, lower: bool):
    """P(a, x) (`lower`) or Q(a, x), with the edge cases of PyTorch's kernel: NaN for negative
    arguments, a == 0 and x == 0 decided first, then infinite a, then infinite x."""
    a, x = jnp.broadcast_arrays(a, x)
    one, zero = jnp.ones_like(a), jnp.zeros_like(a)
    full, empty = (one, zero) if lower else (zero, one)
    nan = jnp.full_like(a, jnp.nan)
    value = regularized(a, x)
    value = jnp.where(jnp.isinf(x), full, value)
    value = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), nan, empty), value)
    value = jnp.where(x == 0, empty, value)
    value = jnp.where(a == 0, jnp.where(x > 0, full, nan), value)
    return jnp.where((x < 0) | (a < 0), nan, value)


@pointwise(aten.igamma.default, promotion=INT_TO_FLOAT)
def igamma(ctx, a, x):
    return _incomplete_gamma(a, x, jss.gammainc, lower=True)


@pointwise(aten.igammac.default, promotion=INT_TO_FLOAT)
def igammac(ctx, a, x):
    return _incomplete_gamma(a, x, jss.gammaincc, lower=False)


# --- Hurwitz zeta and polygamma --------------------------------------------------------------------


def _bernoulli_even(count: int) -> list[Fraction]:
    """B_2, B_4, ..., B_2count, exactly (from the recurrence sum_k C(m+1, k) B_k = 0)."""
    numbers = [Fraction(1)]
    for m in range(1, 2 * count + 1):
        numbers.append(-sum(math.comb(m + 1, k) * numbers[k] for k in range(m)) / (m + 1))
    return numbers[2::2]


# Euler-Maclaurin correction coefficients B_2j / (2j)!.
_EM_COEFFICIENTS = tuple(
    float(b / math.factorial(2 * j)) for j, b in enumerate(_bernoulli_even(12), start=1)
)


def _zeta(s, q):
    """Hurwitz zeta sum_k (q + k)^-s for s > 1: direct terms until q + k > 9 (and at least 9
    terms), then the Euler-Maclaurin tail; both stop once a term falls below epsilon. For
    q <= 0 it is finite only at non-integer q and integer s."""
    s, q = jnp.broadcast_arrays(s, q)
    eps = jnp.finfo(s.dtype).eps
    integer_q = q == jnp.floor(q)
    huge_q = q > 1e8
    pole = (q <= 0) & integer_q
    undefined = (q <= 0) & (s != jnp.floor(s))
    skip = ~(s > 1) | pole | undefined | huge_q | ~jnp.isfinite(q)

    def pending(state):
        _, _, a, count, converged, _ = state
        return ~converged & ((count < 9) | (a <= 9))

    def add_term(state):
        # Neumaier's compensated sum: for q < 0, terms of opposite signs cancel to a small value.
        total, compensation, a, count, converged, last = state
        active = pending(state)
        a = jnp.where(active, a + 1, a)
        term = jnp.where(active, a ** -s, 0)
        new_total = total + term
        compensation = compensation + jnp.where(
            jnp.abs(total) >= jnp.abs(term), (total - new_total) + term, (term - new_total) + total
        )
        converged = converged | (active & (jnp.abs(term / new_total) < eps))
        return new_total, compensation, a, count + active, converged, jnp.where(active, term, last)

    first = jnp.where(skip, 1, q) ** -s
    zeros = jnp.zeros_like(s)
    state = (first, zeros, jnp.where(skip, 10, q), jnp.zeros(s.shape, jnp.int32), skip, first)
    total, compensation, w, _, converged, last = lax.while_loop(lambda st: jnp.any(pending(st)), add_term, state)
    total = total + compensation
    tail = total + last * w / (s - 1) - last / 2
    stopped = converged
    rising, power = jnp.ones_like(s), last
    for j, coefficient in enumerate(_EM_COEFFICIENTS):
        rising = rising * (s + 2 * j)
        power = power / w
        term = coefficient * rising * power
        tail = tail + jnp.where(stopped, 0, term)
        stopped = stopped | (jnp.abs(term / tail) < eps)
        rising = rising * (s + 2 * j + 1)
        power = power / w
    value = jnp.where(converged, total, tail)
    value = jnp.where(huge_q, (1 / (s - 1) + 1 / (2 * q)) * q ** (1 - s), value)
    value = jnp.where(pole, jnp.inf, jnp.where(undefined | jnp.isnan(q), jnp.nan, value))
    return jnp.where(s == 1, jnp.inf, jnp.where((s < 1) | jnp.isnan(s), jnp.nan, value))


for _op in (aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar):
    pointwise(_op, promotion=INT_TO_FLOAT)(elementwise(_zeta))


@pointwise(aten.polygamma.default, promotion=INT_TO_FLOAT, operands=("self",))
def polygamma(ctx, n, x):
    if n == 0:
        return _digamma(x)
    # psi^(n)(x) = (-1)^(n+1) n! zeta(n + 1, x)
    sign = 1.0 if n % 2 else -1.0
    return sign * math.factorial(n) * _zeta(jnp.full_like(x, n + 1), x)
