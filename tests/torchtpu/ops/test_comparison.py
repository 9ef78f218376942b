"""Comparisons, logic, bits, extrema, clamp, where and the float predicates on `tpu`, against
PyTorch's CPU kernels: NaN handling, promotion between tensors and Python scalars, shifts out of
range, clamp with bounds crossing, broadcasting and in-place forms."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._pytree import tree_map

import torchtpu  # noqa: F401

NAN, INF = math.nan, math.inf


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


def same_as_cpu(fn, *args):
    """`fn` on `tpu` copies of `args` equals `fn` on the CPU originals (dtype included)."""
    expected = fn(*args)
    moved = tree_map(lambda x: x.to("tpu") if isinstance(x, torch.Tensor) else x, args)
    actual = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, fn(*moved))
    torch.testing.assert_close(actual, expected, equal_nan=True)


X = torch.tensor([[-2.0, -0.0, 0.0, 0.5, 1.0, NAN, INF, -INF]])
Y = torch.tensor([[0.0], [1.0], [NAN], [-INF]])
I = torch.tensor([[-9, -1, 0, 3, 7, 100]])
J = torch.tensor([[2], [-3], [0]])

COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


@pytest.mark.parametrize("name", COMPARE)
def test_comparisons(name):
    op = COMPARE[name]
    same_as_cpu(op, X, Y)
    same_as_cpu(op, I, J)
    # A float scalar against integers compares in floating point: 2.5 is not rounded to 2.
    same_as_cpu(lambda a: (op(a, 2.5), op(a, 3), op(a, torch.tensor(0.5))), I)
    same_as_cpu(lambda a, b: op(a, b), X.to(torch.bfloat16), X)


LOGICAL = {"and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor}


@pytest.mark.parametrize("name", LOGICAL)
def test_logical_treats_nan_as_true(name):
    same_as_cpu(LOGICAL[name], X, Y)
    same_as_cpu(LOGICAL[name], I, J)
    same_as_cpu(lambda a: torch.logical_not(a), X)


BITS = {"and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor}


@pytest.mark.parametrize("name", BITS)
def test_bitwise(name):
    same_as_cpu(BITS[name], I, J)
    same_as_cpu(lambda a: BITS[name](a, 6), I.to(torch.uint8))
    same_as_cpu(BITS[name], torch.tensor([True, False, True]), torch.tensor([True, True, False]))
    same_as_cpu(torch.bitwise_not, I.to(torch.int8))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
def test_shifts_out_of_range_follow_the_cpu_kernel(dtype):
    x = torch.tensor([[1, 5, 100, -100, -1]]).to(dtype)
    shift = torch.tensor([[0], [1], [7], [8], [63], [64], [-1]]).to(dtype)
    same_as_cpu(lambda a, s: (a << s, a >> s, torch.bitwise_left_shift(a, s), torch.bitwise_right_shift(a, s)), x, shift)
    same_as_cpu(lambda a: (a << 2, a >> 3, torch.bitwise_left_shift(1, a.abs() % 7)), x)


def test_maximum_minimum_propagate_nan_fmax_fmin_ignore_it():
    for op in (torch.maximum, torch.minimum, torch.fmax, torch.fmin):
        same_as_cpu(op, X, Y)
        same_as_cpu(op, I, J)
    same_as_cpu(lambda a, b: (torch.max(a, b), torch.min(a, b)), X, Y)


def test_clamp_scalar_and_tensor_bounds():
    same_as_cpu(lambda x: (x.clamp(-1, 0.5), x.clamp(min=0.25), x.clamp(max=-0.5), x.clamp(1, -1)), X)
    same_as_cpu(lambda x, lo: (x.clamp(lo, lo + 1), x.clamp(min=lo), x.clamp(max=lo)), X, Y)
    same_as_cpu(lambda x: (x.clamp(NAN, 1), x.clamp_min(0), x.clamp_max(0.5)), X)
    # Integer tensors with float bounds promote to float, as on CPU.
    same_as_cpu(lambda x: (x.clamp(-2, 5), x.clamp(-2.5, 4.5)), I)
    same_as_cpu(lambda x: x.clone().clamp_(-1, 1), X)


def test_where_promotes_and_broadcasts():
    condition = torch.tensor([[True], [False], [True], [False]])
    same_as_cpu(torch.where, condition, X, Y)
    same_as_cpu(lambda c, a: torch.where(c, a, 0), condition, I)
    same_as_cpu(lambda c, a: torch.where(c, a, 2.5), condition, I)
    same_as_cpu(lambda c, a, b: torch.where(c, a, b), condition, X.to(torch.bfloat16), X)


@pytest.mark.parametrize("x", [X, X.to(torch.bfloat16), I, torch.tensor([True, False])], ids=["f32", "bf16", "int", "bool"])
def test_predicates(x):
    same_as_cpu(
        lambda a: (torch.isnan(a), torch.isinf(a), torch.isposinf(a), torch.isneginf(a), torch.isfinite(a), torch.signbit(a)),
        x,
    )


@pytest.mark.parametrize(
    "x, y",
    [(X, X), (X[:, :5], X[:, :5].clone()), (I, I.float()), (I, I + 1), (I > 0, (I > 0).long()),
     (I, I.t()), (torch.zeros(0), torch.zeros(0, 1)), (X[:, :5], X[:, :5].double())],
    ids=["nan_unequal_to_itself", "equal", "promoted", "differ", "bool_int", "shapes", "empty_shapes", "dtypes"],
)
def test_equal(x, y):
    """`torch.equal` (a Python bool): the same on `tpu` as on CPU."""
    assert torch.equal(x.to("tpu"), y.to("tpu")) is torch.equal(x, y)
