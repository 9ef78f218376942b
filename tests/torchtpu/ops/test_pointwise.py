"""Pointwise math on `tpu` against PyTorch's CPU kernels: special values (NaN, +-inf, +-0),
integer rounding and wraparound, dtype promotion with tensors and Python scalars, broadcasting,
0-dim, empty and non-contiguous inputs, bfloat16, in-place and out= variants through the
executor, and no recompilation when a Python scalar changes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._pytree import tree_map

import torchtpu

NAN, INF = math.nan, math.inf


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    """A CPU fallback is not coverage: make it an error."""
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


def on_tpu(tree):
    return tree_map(lambda x: x.to("tpu") if isinstance(x, torch.Tensor) else x, tree)


def same_as_cpu(fn, *args, **tolerance):
    """`fn` on `tpu` copies of `args` equals `fn` on the CPU originals (dtype included)."""
    expected = fn(*args)
    actual = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, fn(*on_tpu(args)))
    torch.testing.assert_close(actual, expected, equal_nan=True, **tolerance)


SPECIAL = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5, 1e-30, 3e4, -7.25, NAN, INF, -INF])
RANDOM = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)) * 3
STRIDED = RANDOM.transpose(0, 2)[:, ::2]  # non-contiguous
PERMUTED = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1)).permute(2, 1, 0)
INTS = torch.tensor([-7, -4, -3, -1, 0, 1, 2, 3, 5, 8])
BF16 = RANDOM.to(torch.bfloat16)

UNARY = {
    "abs": torch.abs, "neg": torch.neg, "sign": torch.sign, "sgn": torch.sgn,
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log,
    "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos,
    "tan": torch.tan, "asin": torch.asin, "acos": torch.acos, "atan": torch.atan,
    "sinh": torch.sinh, "cosh": torch.cosh, "tanh": torch.tanh, "asinh": torch.asinh,
    "acosh": torch.acosh, "atanh": torch.atanh, "sigmoid": torch.sigmoid, "floor": torch.floor,
    "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round, "frac": torch.frac,
    "round_decimals_2": lambda x: torch.round(x, decimals=2),
    "round_decimals_neg_1": lambda x: torch.round(x, decimals=-1),
    "sinc": torch.sinc, "deg2rad": torch.deg2rad, "rad2deg": torch.rad2deg, "angle": torch.angle,
    "square": torch.square, "positive": torch.positive, "nan_to_num": torch.nan_to_num,
    "nan_to_num_values": lambda x: torch.nan_to_num(x, nan=1.5, posinf=7.0, neginf=-9.0),
    "frexp": lambda x: tuple(torch.frexp(x)),
}  # fmt: skip
INTEGER_UNARY = ("abs", "neg", "sign", "floor", "ceil", "trunc", "round", "exp", "sqrt", "sin", "sigmoid", "square")


@pytest.mark.parametrize("name", UNARY)
def test_unary_special_values(name):
    same_as_cpu(UNARY[name], SPECIAL)


@pytest.mark.parametrize("name", ["exp", "tanh", "round", "log1p", "frexp", "nan_to_num", "sign"])
@pytest.mark.parametrize("x", [STRIDED, BF16, torch.tensor(-1.5), torch.zeros(0, 3)], ids=["strided", "bf16", "0dim", "empty"])
def test_unary_layouts_and_dtypes(name, x):
    same_as_cpu(UNARY[name], x)


@pytest.mark.parametrize("name", INTEGER_UNARY)
def test_unary_integers(name):
    # Integer rounding is the identity; int -> float ops promote to the default dtype.
    same_as_cpu(UNARY[name], INTS)


def test_abs_and_neg_wrap_around_like_cpu():
    extremes = torch.tensor([-128, -1, 127], dtype=torch.int8)
    same_as_cpu(lambda x: (torch.abs(x), torch.neg(x)), extremes)


A = torch.tensor([[7.0, -7.0, 7.5, -7.5, 0.0, -0.0, 1e30, 3.0, NAN, INF]])
B = torch.tensor([[2.0], [-2.0], [0.0], [0.5]])  # broadcasts against A
IA = torch.tensor([[7, -7, 6, -6, 0, 1, -1, 13]])
IB = torch.tensor([[2], [-2], [3], [-5]])

BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=3), "sub_alpha": lambda a, b: torch.sub(a, b, alpha=2),
    "rsub": lambda a, b: torch.rsub(a, b, alpha=2),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "floor_divide": torch.floor_divide, "remainder": torch.remainder, "fmod": torch.fmod,
    "pow": torch.pow, "atan2": torch.atan2, "hypot": torch.hypot, "copysign": torch.copysign,
    "nextafter": torch.nextafter, "ldexp": torch.ldexp, "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2, "heaviside": torch.heaviside, "float_power": torch.float_power,
    "true_divide": torch.true_divide,
}  # fmt: skip
INTEGER_BINARY = ("add", "sub", "mul", "div", "add_alpha", "div_trunc", "div_floor", "floor_divide",
                  "remainder", "fmod", "pow", "atan2", "copysign", "ldexp")  # fmt: skip


@pytest.mark.parametrize("name", BINARY)
def test_binary_broadcast_special_values(name):
    same_as_cpu(BINARY[name], A, B)


@pytest.mark.parametrize("name", INTEGER_BINARY)
def test_binary_integers(name):
    # Integer division rounds toward zero (trunc) or -inf (floor); the remainder takes the
    # divisor's sign, fmod the dividend's. No zero divisors: see pointwise.py.
    same_as_cpu(BINARY[name], IA, IB.abs() if name == "pow" else IB)


def test_floor_divide_is_exact_across_rounding():
    # Quotients whose float division rounds up to the next integer: c10's formula corrects them.
    # (No subnormals: XLA, like the TPU, flushes them to zero.)
    a = torch.tensor([1.0, -1.0, 0.3, -0.3, 5.0, 1e-30, 4.0])
    b = torch.tensor([0.1, 0.1, 0.1, 0.1, -0.0, 3e-30, 1e-30])
    same_as_cpu(lambda x, y: (torch.floor_divide(x, y), torch.remainder(x, y)), a, b)


def test_integer_pow():
    # Repeated squaring wraps like C++; negative exponents follow powi (1, -1 -> +-1, else 0).
    base = torch.tensor([[2, -2, 3, 1, -1, 0, 7]])
    exponent = torch.tensor([[0], [1], [5], [13], [-1], [-2]])
    same_as_cpu(torch.pow, base, exponent)
    same_as_cpu(torch.pow, torch.tensor([3, -5, 100], dtype=torch.int8), torch.tensor([5, 3, 3], dtype=torch.int8))
    same_as_cpu(lambda b: b**3, base)
    same_as_cpu(lambda e: 2**e, exponent.abs())


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x + 2, lambda x: x * 2.5, lambda x: 2.5 / x, lambda x: x + True, lambda x: x ** 0.5,
        lambda x: x % 3, lambda x: 3 % x, lambda x: x // 2.5, lambda x: torch.add(x, 1.5, alpha=2),
    ],
    ids=["int", "float", "rdiv", "bool", "pow", "mod", "rmod", "floordiv", "scalar_alpha"],
)
@pytest.mark.parametrize("x", [INTS, RANDOM, BF16, torch.tensor(3)], ids=["int64", "float32", "bf16", "0dim"])
def test_python_scalar_operands_promote_like_cpu(fn, x):
    if x.dtype == torch.bfloat16:
        same_as_cpu(fn, x, rtol=1.6e-2, atol=1e-2)
    else:
        same_as_cpu(fn, x.abs() + 1 if x.dtype != torch.float32 else x)


def test_mixed_dtype_promotion():
    same_as_cpu(torch.add, INTS.to(torch.int8), INTS.to(torch.int32))
    same_as_cpu(torch.mul, BF16[0, 0], RANDOM[0, 0])
    same_as_cpu(torch.div, INTS, torch.tensor(4))
    same_as_cpu(lambda a, b: a + b, torch.tensor([True, False]), torch.tensor([True, True]))
    same_as_cpu(lambda a, b: a * b, torch.tensor([200, 100], dtype=torch.uint8), torch.tensor(3, dtype=torch.uint8))


TERNARY = {
    "addcmul": lambda x, a, b: torch.addcmul(x, a, b, value=0.5),
    "addcdiv": lambda x, a, b: torch.addcdiv(x, a, b, value=-2),
    "lerp_scalar": lambda x, a, b: torch.lerp(x, a, 0.75),
    "lerp_tensor": lambda x, a, b: torch.lerp(x, a, b.sigmoid()),
}


@pytest.mark.parametrize("name", TERNARY)
def test_ternary_broadcast(name):
    same_as_cpu(TERNARY[name], RANDOM, RANDOM[0], PERMUTED)


def test_lerp_is_exact_at_both_ends():
    same_as_cpu(lambda x, y: (torch.lerp(x, y, 0.0), torch.lerp(x, y, 1.0)), RANDOM, RANDOM.exp())


def test_addcmul_integers_wrap():
    x = torch.tensor([100, -100], dtype=torch.int8)
    same_as_cpu(lambda a: torch.addcmul(a, a, a, value=3), x)


def test_gcd_lcm():
    a = torch.tensor([[0, 6, -12, 17, 1 << 40, -9]])
    b = torch.tensor([[0], [4], [-18], [5]])
    same_as_cpu(lambda x, y: (torch.gcd(x, y), torch.lcm(x, y)), a, b)


def test_nan_to_num_bf16_uses_bf16_limits():
    x = torch.tensor([NAN, INF, -INF, 1.0], dtype=torch.bfloat16)
    same_as_cpu(torch.nan_to_num, x)


def test_fill_and_zero():
    same_as_cpu(lambda x: (torch.fill(x, 2.5), torch.zero_(x.clone()), torch.fill(x, torch.tensor(7))), RANDOM)


INPLACE = {
    "add_": lambda x, y: x.add_(y, alpha=0.5),
    "mul_scalar_": lambda x, y: x.mul_(3.0),
    "div_floor_": lambda x, y: x.div_(y, rounding_mode="floor"),
    "pow_": lambda x, y: x.abs_().pow_(y),
    "pow_scalar_": lambda x, y: x.pow_(2),
    "polygamma_": lambda x, y: x.abs_().add_(0.5).polygamma_(1),  # polygamma(n, self): other order
    "ldexp_": lambda x, y: x.ldexp_(torch.full_like(x, 3)),
    "clamp_": lambda x, y: x.clamp_(-0.5, 0.5),
    "exp_": lambda x, y: x.exp_(),
    "lerp_": lambda x, y: x.lerp_(y, 0.3),
    "addcdiv_": lambda x, y: x.addcdiv_(y, y.abs() + 1, value=0.1),
}


@pytest.mark.parametrize("fn", INPLACE.values(), ids=INPLACE.keys())
def test_inplace_variants(fn):
    def run(x, y):
        x = x.clone()
        result = fn(x, y)
        assert result is x
        return x

    same_as_cpu(run, RANDOM, RANDOM[1])


def test_inplace_into_a_noncontiguous_view():
    def run(x):
        base = x.clone()
        view = base.transpose(0, 2)[:, ::2]
        view.mul_(-2).add_(1)
        return base

    same_as_cpu(run, RANDOM)


def test_out_variants():
    def run(x, y):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.mul(x, y, out=out)
        ints = torch.empty(x.shape, dtype=torch.int64, device=x.device)
        torch.floor_divide(x.round().to(torch.int64), 3, out=ints)
        return out, ints

    same_as_cpu(run, RANDOM, RANDOM[0])


def test_out_variant_resizes_an_empty_out():
    def run(x):
        out = torch.empty(0, device=x.device)
        return torch.exp(x, out=out)

    same_as_cpu(run, RANDOM)


def test_out_variant_resizes_a_wrong_shape_with_pytorchs_warning():
    def run(x):
        out = torch.empty(5, device=x.device)
        with pytest.warns(UserWarning, match="An output with one or more elements was resized"):
            result = torch.mul(x, 2, out=out)
        assert result is out
        return out

    same_as_cpu(run, RANDOM)


def test_inplace_overloads_found_by_argument_schema():
    """`float_power_.Scalar` is `float_power.Tensor_Scalar`, `float_power_.Tensor` is
    `float_power.Tensor_Tensor`, `pow_.Tensor` is `pow.Tensor_Tensor` (not same-named overloads)."""

    def run(x, y):
        x = x.double()
        a, b, c = x.clone(), x.clone(), x.abs()
        assert a.float_power_(3) is a and b.float_power_(y.double()) is b and c.pow_(y.double()) is c
        return a, b, c

    same_as_cpu(run, RANDOM, RANDOM[1])


def test_integer_power_checks_every_new_exponent():
    """CPU rejects an integer tensor to a negative integer Scalar power; the cached program of
    `x ** 2` must not skip that check for `x ** -1`."""
    x = torch.arange(1, 7).reshape(2, 3)
    same_as_cpu(lambda t: t ** 2, x)
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
            x.to(device) ** -1
        with pytest.raises(RuntimeError, match="Integers to negative integer powers are not allowed"):
            x.to(device).clone().pow_(-2)
    same_as_cpu(lambda t: t ** -1.0, x)  # a float exponent promotes instead


def test_integer_out_of_float_op_is_refused_like_cpu():
    out = torch.empty(3, dtype=torch.int64).to("tpu")
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.div(torch.ones(3).to("tpu"), 2, out=out)


def test_changing_python_scalars_does_not_recompile():
    x = RANDOM.to("tpu")
    y = RANDOM[0].to("tpu")

    def step(s):
        return [x * s, x.add(y, alpha=s), torch.pow(x, s), torch.clamp(x, -s, s), torch.lerp(x, y, s)]

    step(0.5)
    torchtpu.reset_metrics()
    results = step(0.25)
    assert torchtpu.metrics().get("eager_programs", 0) == 0
    torch.testing.assert_close(results[1].cpu(), RANDOM.add(RANDOM[0], alpha=0.25))
