"""Classical orthogonal polynomials of `torch.special`: Chebyshev T, U, V, W (and shifted),
Hermite H and He, Laguerre L, Legendre P, each evaluated at x for a degree tensor n.

As in PyTorch's kernels, n is truncated to an integer (negative degrees give 0), the values at
the interval's end points are exact, Chebyshev polynomials of high degree inside (-1, 1) use
their trigonometric closed forms, and everything else runs the three-term recurrence -- here for
all elements at once, up to the largest degree in the tensor (a `while_loop`, masked per element).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.ops.promotion import INT_TO_FLOAT, pointwise

aten = torch.ops.aten


def _recurrence(x, n, p0, p1, step: Callable):
    """p_n(x) from p_0, p_1 and p_{m+1} = step(m, x, p_m, p_{m-1}), for integer-valued n >= 0."""
    x, n, p0, p1 = jnp.broadcast_arrays(x, n, p0, p1)

    def advance(state):
        m, previous, current = state
        following = step(m, x, current, previous)
        active = m < n
        return m + 1, jnp.where(active, current, previous), jnp.where(active, following, current)

    top = jnp.max(n, initial=0)
    _, _, value = lax.while_loop(lambda s: s[0] < top, advance, (jnp.ones((), x.dtype), p0, p1))
    return jnp.where(n == 0, p0, value)


def _even(n):
    return jnp.remainder(n, 2) == 0


def _alternating(n, value):
    """value for even n, -value for odd n."""
    return jnp.where(_even(n), value, -value)


def _chebyshev(x, n, p1, closed_form, at_minus_one, at_plus_one, closed_from: int):
    """A Chebyshev-like polynomial with recurrence p_{m+1} = 2x p_m - p_{m-1} from p_0 = 1."""
    one = jnp.ones_like(x)
    value = _recurrence(x, n, one, p1, lambda m, y, current, previous: (y + y) * current - previous)
    inside = (n > closed_from) & (jnp.abs(x) < 1)
    theta = jnp.arccos(jnp.where(inside, x, 0))
    value = jnp.where(inside, closed_form(theta, n), value)
    value = jnp.where(x == 1, at_plus_one(n) * one, jnp.where(x == -1, at_minus_one(n) * one, value))
    return jnp.where(n < 0, jnp.zeros_like(x), value)


def _chebyshev_t(x, n):
    return _chebyshev(x, n, x, lambda t, n: jnp.cos(n * t), lambda n: _alternating(n, 1.0), lambda n: 1.0, 6)


def _chebyshev_u(x, n):
    def closed(t, n):
        s = jnp.sin(t)
        return jnp.where(s != 0, jnp.sin((n + 1) * t) / jnp.where(s != 0, s, 1), (n + 1) * jnp.cos((n + 1) * t) / x)

    return _chebyshev(x, n, x + x, closed, lambda n: _alternating(n, n + 1), lambda n: n + 1, 8)


def _chebyshev_v(x, n):
    def closed(t, n):
        half = jnp.cos(t / 2)
        degenerate = jnp.sin(t / 2) == 1
        return jnp.where(degenerate, _alternating(n, n + n + 1), jnp.cos((n + 0.5) * t) / jnp.where(degenerate, 1, half))

    return _chebyshev(x, n, x + x - 1, closed, lambda n: _alternating(n, n + n + 1), lambda n: 1.0, 8)


def _chebyshev_w(x, n):
    def closed(t, n):
        half = jnp.sin(t / 2)
        degenerate = jnp.cos(t / 2) == 1
        return jnp.where(degenerate, n + n + 1, jnp.sin((n + 0.5) * t) / jnp.where(degenerate, 1, half))

    return _chebyshev(x, n, x + x + 1, closed, lambda n: _alternating(n, 1.0), lambda n: n + n + 1, 8)


def _shifted(polynomial: Callable) -> Callable:
    """p*(x) = p(2x - 1): x = 1 and x = 0 map to the end points +1 and -1 exactly."""

    def shifted(x, n):
        return polynomial(x + x - 1, n)

    shifted.__name__ = f"shifted_{polynomial.__name__.lstrip('_')}"
    return shifted


def _hermite_h(x, n):
    value = _recurrence(x, n, jnp.ones_like(x), x + x, lambda m, y, current, previous: (y + y) * current - 2 * m * previous)
    return jnp.where(n < 0, jnp.zeros_like(x), value)


def _hermite_he(x, n):
    value = _recurrence(x, n, jnp.ones_like(x), x, lambda m, y, current, previous: y * current - m * previous)
    return jnp.where(n < 0, jnp.zeros_like(x), value)


def _laguerre_l(x, n):
    def step(m, y, current, previous):
        return ((m + m + (1 - y)) * current - m * previous) / (m + 1)

    value = _recurrence(x, n, jnp.ones_like(x), 1 - x, step)
    value = jnp.where(x == 0, jnp.ones_like(x), value)
    return jnp.where(n < 0, jnp.zeros_like(x), value)


def _legendre_p(x, n):
    def step(m, y, current, previous):
        return ((m + m + 1) * y * current - m * previous) / (m + 1)

    value = _recurrence(x, n, jnp.ones_like(x), x, step)
    ones = jnp.ones_like(x)
    value = jnp.where(x == 1, ones, jnp.where(x == -1, _alternating(n, 1.0) * ones, value))
    return jnp.where(n < 0, jnp.zeros_like(x), value)


_POLYNOMIALS: dict[str, Callable] = {
    "chebyshev_polynomial_t": _chebyshev_t,
    "chebyshev_polynomial_u": _chebyshev_u,
    "chebyshev_polynomial_v": _chebyshev_v,
    "chebyshev_polynomial_w": _chebyshev_w,
    "shifted_chebyshev_polynomial_t": _shifted(_chebyshev_t),
    "shifted_chebyshev_polynomial_u": _shifted(_chebyshev_u),
    "shifted_chebyshev_polynomial_v": _shifted(_chebyshev_v),
    "shifted_chebyshev_polynomial_w": _shifted(_chebyshev_w),
    "hermite_polynomial_h": _hermite_h,
    "hermite_polynomial_he": _hermite_he,
    "laguerre_polynomial_l": _laguerre_l,
    "legendre_polynomial_p": _legendre_p,
}


def _of_truncated_degree(polynomial: Callable) -> Callable:
    def lowering(ctx, x, n):
        # PyTorch casts the degree to int64: truncation toward zero.
        return polynomial(*jnp.broadcast_arrays(x, jnp.trunc(n)))

    lowering.__name__ = polynomial.__name__
    return lowering


for _name, _polynomial in _POLYNOMIALS.items():
    _packet = getattr(aten, f"special_{_name}")
    for _overload in ("default", "x_scalar", "n_scalar"):
        pointwise(getattr(_packet, _overload), promotion=INT_TO_FLOAT, operands=("x", "n"))(
            _of_truncated_degree(_polynomial)
        )
