"""Special functions on `tpu` against PyTorch's CPU kernels (Cephes and friends), over wide value
ranges and their edge cases: poles and zeros, negative arguments (zeta and polygamma at
negative non-integer x), infinities and NaN, and large arguments where naive formulas overflow."""

from __future__ import annotations

import math

import pytest
import torch

import torchtpu  # noqa: F401

NAN, INF = math.nan, math.inf


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


def same_as_cpu(fn, *args, rtol=1e-4, atol=1e-5):
    """OpInfo's float32 tolerances: the reference is PyTorch's float32 CPU kernel."""
    expected = fn(*args)
    actual = fn(*(a.to("tpu") for a in args))
    torch.testing.assert_close(actual.cpu(), expected, equal_nan=True, rtol=rtol, atol=atol)


_g = torch.Generator().manual_seed(0)
WIDE = torch.cat([torch.linspace(-30, 30, 601), torch.tensor([0.0, -0.0, 1e-20, -1e-20, 85.0, NAN, INF, -INF])])
POSITIVE = torch.cat([torch.logspace(-6, 2.5, 200), torch.tensor([0.0, NAN, INF])])
UNIT = torch.cat([torch.linspace(-1, 1, 201), torch.tensor([1e-7, 1 - 1e-7, NAN])])

UNARY = {
    "erf": (torch.erf, WIDE), "erfc": (torch.erfc, WIDE), "erfinv": (torch.erfinv, UNIT),
    "lgamma": (torch.lgamma, WIDE), "digamma": (torch.digamma, WIDE), "i0": (torch.i0, WIDE),
    "i0e": (torch.special.i0e, WIDE), "i1": (torch.special.i1, WIDE), "i1e": (torch.special.i1e, WIDE),
    "ndtr": (torch.special.ndtr, WIDE), "ndtri": (torch.special.ndtri, UNIT.abs()),
    "log_ndtr": (torch.special.log_ndtr, WIDE), "erfcx": (torch.special.erfcx, WIDE),
    "entr": (torch.special.entr, WIDE), "expit": (torch.special.expit, WIDE),
    "spherical_bessel_j0": (torch.special.spherical_bessel_j0, WIDE),
    "modified_bessel_i0": (torch.special.modified_bessel_i0, WIDE),
    "modified_bessel_i1": (torch.special.modified_bessel_i1, WIDE),
    "logit": (torch.logit, UNIT.abs()),
}  # fmt: skip


@pytest.mark.parametrize("name", UNARY)
def test_unary(name):
    fn, x = UNARY[name]
    same_as_cpu(fn, x)


def test_digamma_poles():
    # +-0 are poles of opposite sign; negative integers are NaN.
    same_as_cpu(torch.digamma, torch.tensor([0.0, -0.0, -1.0, -2.0, -2.5, 1.0]))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_polygamma_including_negative_arguments(n):
    x = torch.linspace(-9.75, 10, 80)
    x = torch.cat([x[x != x.round()], torch.tensor([1e-3, 1.0, 50.0])])
    same_as_cpu(lambda t: torch.polygamma(n, t), x)


def test_polygamma_poles_are_infinite():
    # PyTorch's trigamma returns large finite values at the poles (sin(pi x) rounds away from
    # 0); the poles themselves are infinite, which is what tpu returns.
    poles = torch.tensor([0.0, -1.0, -4.0])
    for n in (1, 2, 3):
        assert torch.polygamma(n, poles.to("tpu")).cpu().abs().min() == INF


def test_zeta():
    s = torch.tensor([[1.0], [1.5], [2.0], [3.0], [4.5], [7.0], [20.0], [0.5]])
    q = torch.tensor([[-7.5, -3.0, -1.5, -0.25, 0.0, 0.1, 1.0, 2.5, 9.5, 100.0, 1e9]])
    same_as_cpu(torch.special.zeta, s, q)
    same_as_cpu(lambda x: torch.special.zeta(x, 2.0), s)
    same_as_cpu(lambda x: torch.special.zeta(3.0, x), q)


def test_incomplete_gamma_edges():
    a = torch.tensor([[0.0], [0.5], [2.0], [30.0], [INF], [-1.0]])
    x = torch.tensor([[0.0, 0.1, 1.0, 2.0, 40.0, INF, NAN]])
    same_as_cpu(torch.igamma, a, x)
    same_as_cpu(torch.igammac, a, x)


def test_xlogy_xlog1py_zero_and_nan():
    x = torch.tensor([[0.0, 0.0, 2.0, -1.0, NAN]])
    y = torch.tensor([[0.0], [-1.0], [NAN], [3.0], [INF]])
    same_as_cpu(torch.xlogy, x, y)
    same_as_cpu(torch.special.xlog1py, x, y)
    same_as_cpu(lambda t: (torch.xlogy(t, 2.0)), x)
    same_as_cpu(lambda t: (torch.special.xlog1py(3.0, t)), y)


def test_logit_eps_clamps_and_negative_eps_does_not():
    x = torch.tensor([-0.5, 0.0, 0.05, 0.5, 0.97, 1.0, 1.5])
    same_as_cpu(lambda t: torch.logit(t, eps=0.1), x)
    same_as_cpu(lambda t: torch.logit(t, eps=-0.1), x)


def test_mvlgamma():
    same_as_cpu(lambda t: torch.mvlgamma(t, 3), torch.linspace(1.5, 20, 40))


def test_bfloat16_computes_in_float32():
    x = torch.linspace(0.1, 8, 50).to(torch.bfloat16)
    for fn in (torch.lgamma, torch.digamma, torch.erfinv, torch.special.i0e):
        same_as_cpu(fn, x / 8 if fn is torch.erfinv else x, rtol=1.6e-2, atol=1e-2)


BESSEL = {
    "bessel_j0": torch.special.bessel_j0, "bessel_j1": torch.special.bessel_j1,
    "bessel_y0": torch.special.bessel_y0, "bessel_y1": torch.special.bessel_y1,
    "modified_bessel_k0": torch.special.modified_bessel_k0,
    "modified_bessel_k1": torch.special.modified_bessel_k1,
    "scaled_modified_bessel_k0": torch.special.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": torch.special.scaled_modified_bessel_k1,
    "airy_ai": torch.special.airy_ai,
}  # fmt: skip
# Every regime: the series and quadrature ranges, the asymptotic ones, and the switch points.
BESSEL_POINTS = torch.cat([
    torch.linspace(-40, 40, 801), torch.tensor([0.0, -0.0, 1e-6, 1e-30, 2.0, 2.0001, 19.999, 20.0, 20.001,
                                                 -2.0, -2.0001, -7.999, -8.0, -8.001, 150.0, 1e3, NAN, INF, -INF]),
])  # fmt: skip


@pytest.mark.parametrize("name", BESSEL)
def test_bessel_and_airy(name):
    same_as_cpu(BESSEL[name], BESSEL_POINTS)


POLYNOMIALS = (
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
)  # fmt: skip


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_orthogonal_polynomials(name):
    fn = getattr(torch.special, name)
    # End points (of the shifted ones too), both sides of the closed-form degree thresholds,
    # negative and fractional degrees (truncated), NaN.
    x = torch.cat([torch.linspace(-1.5, 1.5, 61), torch.tensor([-1.0, 0.0, 1.0, 0.5, NAN])])[:, None]
    n = torch.tensor([[-2.0, 0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 9.0, 12.0, 2.7, -0.5]])
    same_as_cpu(fn, x, n)
    same_as_cpu(lambda degrees: fn(0.3, degrees), n)
    # (NaN left out: PyTorch's CPU kernel for a Scalar degree returns a neighbour's value there.)
    same_as_cpu(lambda points: fn(points, 3), x[:-1])


@pytest.mark.parametrize("name", [*UNARY, *BESSEL])
def test_integer_inputs_promote_to_float(name):
    fn = UNARY[name][0] if name in UNARY else BESSEL[name]
    same_as_cpu(fn, torch.arange(-12, 13) if name not in ("erfinv", "ndtri", "logit") else torch.tensor([0, 1]))
