"""Bessel functions J0, J1, Y0, Y1, K0, K1 (and exp-scaled K0, K1), and the Airy function Ai.

Computed in the input's own precision (float32 on a TPU, which has no float64) from classical
representations that need no tables of fitted coefficients:

- J_m(x) for m = 0..M at once, |x| < 20: Bessel's integral J_m(x) = (1/2pi) int cos(m t - x sin t)
  over a period, by the trapezoidal rule, which is exact up to aliasing (J_{N-m}(x)) for a
  periodic integrand: N = 128 points, two small matmuls. Y0 and Y1 follow from Neumann's
  series in the J_m; |x| >= 20: Hankel's asymptotic expansions.
- K_nu(x): the series around 0 for x <= 2; beyond, e^-x times the trapezoidal rule on
  int_0^inf exp(-x (cosh t - 1)) cosh(nu t) dt, whose integrand is analytic in a strip and
  decays doubly exponentially (step 1/sqrt(x) resolves its width, 24 points reach its tail).
- Ai(x): Maclaurin series on [-2, 2]; Ai(x) = sqrt(x/3)/pi K_{1/3}(2/3 x^{3/2}) above; Taylor
  series about centres -2.5 ... -7.5 (their values precomputed in float64 at import) below,
  and the asymptotic expansion past -8.

Edge cases follow PyTorch's kernels: J at +-inf is NaN, Y is NaN for x < 0 and -inf at 0, K is
NaN for x < 0 and inf at 0, Ai(+inf) is NaN.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops.pointwise import elementwise, unary

aten = torch.ops.aten

_EULER_GAMMA = 0.5772156649015329

# --- J and Y -------------------------------------------------------------------------------------

_POINTS = 128
_ORDERS = 46  # J_0 .. J_45: Neumann's series to order 45, J_45(20) ~ 1e-10.
_ASYMPTOTIC_FROM = 20.0
_ANGLES = 2 * np.pi * np.arange(_POINTS) / _POINTS
_COS_M = np.cos(np.outer(_ANGLES, np.arange(_ORDERS)))
_SIN_M = np.sin(np.outer(_ANGLES, np.arange(_ORDERS)))


def _bessel_j_orders(x):
    """J_0(x) .. J_{M-1}(x) stacked on a new last axis (valid for |x| < 20)."""
    phase = x[..., None] * jnp.asarray(np.sin(_ANGLES), x.dtype)
    dot = lambda a, b: jnp.einsum("...n,nm->...m", a, jnp.asarray(b, x.dtype), precision=lax.Precision.HIGHEST)  # noqa: E731
    return (dot(jnp.cos(phase), _COS_M) + dot(jnp.sin(phase), _SIN_M)) / _POINTS


def _hankel_coefficients(order: int, terms: int = 12) -> list[float]:
    """a_k(nu) = prod_{i<=k} (4 nu^2 - (2i - 1)^2) / (k! 8^k)."""
    mu, coefficients, a = 4 * order * order, [1.0], 1.0
    for k in range(1, terms):
        a *= (mu - (2 * k - 1) ** 2) / (k * 8)
        coefficients.append(a)
    return coefficients


def _alternating_halves(coefficients: list[float], t):
    """(c0 - c2 t^2 + c4 t^4 - ..., c1 t - c3 t^3 + ...): the two halves of an asymptotic series
    in t with alternating signs, as Hankel's and Airy's expansions split them."""
    p, q, power = jnp.zeros_like(t), jnp.zeros_like(t), jnp.ones_like(t)
    for k, c in enumerate(coefficients):
        term = (-1.0 if (k // 2) % 2 else 1.0) * c * power
        p, q = (p + term, q) if k % 2 == 0 else (p, q + term)
        power = power * t
    return p, q


def _hankel(x, order: int):
    """(J_order(x), Y_order(x)) for large |x|, by Hankel's expansions:
    sqrt(2 / (pi x)) (P cos chi - Q sin chi) and (P sin chi + Q cos chi), chi = x - (order/2 + 1/4) pi."""
    x = jnp.maximum(jnp.abs(x), _ASYMPTOTIC_FROM)
    p, q = _alternating_halves(_hankel_coefficients(order), 1 / x)
    # cos/sin of chi from those of x: subtracting the phase from a large float32 x would round.
    phase = (order / 2 + 0.25) * math.pi
    cos_x, sin_x = jnp.cos(x), jnp.sin(x)
    cos_chi = cos_x * math.cos(phase) + sin_x * math.sin(phase)
    sin_chi = sin_x * math.cos(phase) - cos_x * math.sin(phase)
    scale = jnp.sqrt(2 / (math.pi * x))
    return scale * (p * cos_chi - q * sin_chi), scale * (p * sin_chi + q * cos_chi)


def _neumann_y(x, j, order: int):
    """Y_order(x) from J_0.. J_{M-1}(x) (Neumann's series, A&S 9.1.88 for orders 0 and 1)."""
    log_half = jnp.log(x / 2)
    k = np.arange(1, (_ORDERS - 1 - order) // 2 + 1)
    signs = np.where(k % 2 == 1, -1.0, 1.0)
    if order == 0:
        series = jnp.sum(j[..., 2 * k] * jnp.asarray(signs / k, x.dtype), axis=-1)
        return 2 / math.pi * (log_half + _EULER_GAMMA) * j[..., 0] - 4 / math.pi * series
    weights = signs * (1 + 2 * k) / (k * (1 + k))
    series = jnp.sum(j[..., 1 + 2 * k] * jnp.asarray(weights, x.dtype), axis=-1)
    digamma_2 = 1 - _EULER_GAMMA
    return -2 / (math.pi * x) * j[..., 0] + 2 / math.pi * (log_half - digamma_2) * j[..., 1] - 2 / math.pi * series


def _bessel_j(order: int):
    def bessel_j(x):
        small = jnp.abs(x) < _ASYMPTOTIC_FROM
        near = _bessel_j_orders(jnp.where(small, x, 0))[..., order]
        far, _ = _hankel(x, order)
        if order == 1:
            far = jnp.where(x < 0, -far, far)  # J1 is odd, J0 even
        return jnp.where(small, near, far)

    bessel_j.__name__ = f"bessel_j{order}"
    return bessel_j


def _bessel_y(order: int):
    def bessel_y(x):
        small = x < _ASYMPTOTIC_FROM
        safe = jnp.where(small & (x > 0), x, 1)
        near = _neumann_y(safe, _bessel_j_orders(safe), order)
        _, far = _hankel(x, order)
        value = jnp.where(small, near, far)
        return jnp.where(x < 0, jnp.nan, jnp.where(x == 0, -jnp.inf, value))

    bessel_y.__name__ = f"bessel_y{order}"
    return bessel_y


# --- K -------------------------------------------------------------------------------------------

_SERIES_UP_TO = 2.0
_SERIES_TERMS = 14
_HARMONIC = np.concatenate([[0.0], np.cumsum(1 / np.arange(1, _SERIES_TERMS + 1))])
_QUADRATURE_POINTS = 24


def _k_series(x, order: int):
    """K_0, K_1 for 0 < x <= 2 (A&S 9.6.13 and 9.6.11), with psi(k + 1) = H_k - gamma."""
    quarter_x2, log_half = x * x / 4, jnp.log(x / 2)
    total, term = jnp.zeros_like(x), jnp.ones_like(x)
    for k in range(_SERIES_TERMS):
        if order == 0:
            total = total + term * (_HARMONIC[k] - _EULER_GAMMA - log_half)
            term = term * quarter_x2 / ((k + 1) * (k + 1))
        else:
            psi_sum = _HARMONIC[k] + _HARMONIC[k + 1] - 2 * _EULER_GAMMA
            total = total + term * (log_half - psi_sum / 2)
            term = term * quarter_x2 / ((k + 1) * (k + 2))
    return total if order == 0 else 1 / x + x / 2 * total


def _scaled_k_integral(x, order: float):
    """e^x K_order(x) = int_0^inf exp(-x (cosh t - 1)) cosh(order t) dt, trapezoidal rule."""
    step = jnp.minimum(0.5, 1 / jnp.sqrt(x))
    t = step[..., None] * jnp.arange(_QUADRATURE_POINTS, dtype=x.dtype)
    values = jnp.exp(-x[..., None] * (jnp.cosh(t) - 1)) * jnp.cosh(order * t)
    return step * (jnp.sum(values, axis=-1) - values[..., 0] / 2)


def _bessel_k(order: int, scaled: bool):
    def bessel_k(x):
        series = x <= _SERIES_UP_TO
        near = _k_series(jnp.where(series & (x > 0), x, 1), order)
        far = _scaled_k_integral(jnp.where(series | ~jnp.isfinite(x), 4, x), order)
        value = jnp.where(series, near * jnp.exp(x) if scaled else near, far if scaled else far * jnp.exp(-x))
        value = jnp.where(jnp.isposinf(x), 0, value)
        return jnp.where((x < 0) | jnp.isnan(x), jnp.nan, jnp.where(x == 0, jnp.inf, value))

    bessel_k.__name__ = f"{'scaled_' if scaled else ''}bessel_k{order}"
    return bessel_k


# --- Airy Ai -------------------------------------------------------------------------------------

_AI_0 = 0.355028053887817239  # Ai(0) = 1 / (3^(2/3) Gamma(2/3))
_AI_PRIME_0 = -0.258819403792806798  # Ai'(0) = -1 / (3^(1/3) Gamma(1/3))
_AIRY_TERMS = 24
_CENTRES = -np.arange(2.5, 8.0, 1.0)  # Taylor centres covering [-8, -2)


def _airy_maclaurin(x, terms: int = _AIRY_TERMS):
    """(Ai(x), Ai'(x)) = Ai(0) (f, f') + Ai'(0) (g, g'), f and g the power-series solutions of
    y'' = x y (A&S 10.4.2-3). Works on numpy and jax arrays alike."""
    cube = x * x * x
    f = f_term = 1 + 0 * x
    g = g_term = x
    df = df_term = x * x / 2
    dg = dg_term = 1 + 0 * x
    for k in range(1, terms):
        f_term = f_term * cube / ((3 * k - 1) * (3 * k))
        g_term = g_term * cube / ((3 * k) * (3 * k + 1))
        dg_term = dg_term * cube / ((3 * k - 2) * (3 * k))
        f, g, dg = f + f_term, g + g_term, dg + dg_term
        if k > 1:
            df_term = df_term * cube / ((3 * k - 1) * 3 * (k - 1))
            df = df + df_term
    return _AI_0 * f + _AI_PRIME_0 * g, _AI_0 * df + _AI_PRIME_0 * dg


_CENTRE_VALUES = np.stack(_airy_maclaurin(_CENTRES.astype(np.float64), terms=60), axis=-1)


def _airy_taylor(x):
    """Ai(x) for -8 <= x < -2: Taylor series about the nearest centre c, its coefficients from
    y'' = (c + h) y: a_{n+2} = (c a_n + a_{n-1}) / ((n + 1)(n + 2))."""
    index = jnp.clip(jnp.floor(-x - 2).astype(jnp.int32), 0, len(_CENTRES) - 1)
    centre = jnp.asarray(_CENTRES, x.dtype)[index]
    values = jnp.asarray(_CENTRE_VALUES, x.dtype)[index]
    h = x - centre
    previous, a0, a1 = jnp.zeros_like(x), values[..., 0], values[..., 1]
    total, power = a0 + a1 * h, h
    coefficients = [previous, a0, a1]
    for n in range(_AIRY_TERMS):
        a_next = (centre * coefficients[-2] + coefficients[-3]) / ((n + 1) * (n + 2))
        coefficients.append(a_next)
        power = power * h
        total = total + a_next * power
    return total


# u_k = (2k+1)(2k+3)...(6k-1) / (216^k k!), the coefficients of Ai's expansions (A&S 10.4.59).
_AIRY_ASYMPTOTIC = [1.0]
for _k in range(1, 12):
    _AIRY_ASYMPTOTIC.append(
        _AIRY_ASYMPTOTIC[-1] * (6 * _k - 5) * (6 * _k - 3) * (6 * _k - 1) / ((2 * _k - 1) * 216 * _k)
    )


def _airy_asymptotic_negative(x):
    """Ai(-z) ~ (sin(zeta + pi/4) P - cos(zeta + pi/4) Q) / (sqrt(pi) z^(1/4)), zeta = 2/3 z^(3/2)."""
    z = jnp.maximum(-x, 8.0)
    zeta = 2 / 3 * z * jnp.sqrt(z)
    p, q = _alternating_halves(_AIRY_ASYMPTOTIC, 1 / zeta)
    angle = zeta + math.pi / 4
    return (jnp.sin(angle) * p - jnp.cos(angle) * q) / (math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(z)))


def _airy_ai(x):
    middle = jnp.abs(x) <= 2
    ai_middle, _ = _airy_maclaurin(jnp.where(middle, x, 0))
    positive = jnp.where(x > 2, x, 4)
    zeta = 2 / 3 * positive * jnp.sqrt(positive)
    ai_positive = jnp.sqrt(positive / 3) / math.pi * _scaled_k_integral(zeta, 1 / 3) * jnp.exp(-zeta)
    ai_taylor = _airy_taylor(jnp.where((x < -2) & (x >= -8), x, -3))
    ai_far = _airy_asymptotic_negative(x)
    value = jnp.where(middle, ai_middle, jnp.where(x > 2, ai_positive, jnp.where(x >= -8, ai_taylor, ai_far)))
    return jnp.where(jnp.isposinf(x), jnp.nan, value)  # PyTorch's kernel gives NaN at +inf


_FUNCTIONS: dict = {
    aten.special_bessel_j0.default: _bessel_j(0),
    aten.special_bessel_j1.default: _bessel_j(1),
    aten.special_bessel_y0.default: _bessel_y(0),
    aten.special_bessel_y1.default: _bessel_y(1),
    aten.special_modified_bessel_k0.default: _bessel_k(0, scaled=False),
    aten.special_modified_bessel_k1.default: _bessel_k(1, scaled=False),
    aten.special_scaled_modified_bessel_k0.default: _bessel_k(0, scaled=True),
    aten.special_scaled_modified_bessel_k1.default: _bessel_k(1, scaled=True),
    aten.special_airy_ai.default: _airy_ai,
}
for _op, _fn in _FUNCTIONS.items():
    unary(_op)(elementwise(_fn))
