"""Pooling on `tpu` against PyTorch's CPU kernels: max pools with indices (ceil_mode, padding,
dilation, ties, NaN and -inf), average pools (count_include_pad, divisor_override, ceil_mode),
adaptive pools with uneven windows, fractional max pools from given samples, max_unpool,
unbatched inputs, bf16, and every backward op."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401
from value_and_grad import Draws

DRAWS = Draws(0)
GEN, randn = DRAWS.generator, DRAWS.randn
NAN, INF = math.nan, math.inf



def check(fn, x):
    """Values (and indices, exactly) equal CPU's; gradients through the values too."""
    same_as_cpu(fn, x, exact=False)
    grads_same_as_cpu(lambda v: fn(v)[0] if isinstance(fn(v), tuple) else fn(v), x)


# (kernel, stride, padding, dilation, ceil_mode)
MAX_SETTINGS = [(3, 2, 1, 1, True), (2, 2, 0, 1, False), (3, 1, 1, 2, True), (2, 3, 1, 1, True)]


@pytest.mark.parametrize("kernel, stride, padding, dilation, ceil_mode", MAX_SETTINGS)
def test_max_pool(kernel, stride, padding, dilation, ceil_mode):
    args = (kernel, stride, padding, dilation)
    check(lambda x: F.max_pool1d(x, *args, ceil_mode=ceil_mode, return_indices=True), randn(2, 3, 9))
    check(lambda x: F.max_pool2d(x, *args, ceil_mode=ceil_mode, return_indices=True), randn(2, 3, 9, 8))
    check(lambda x: F.max_pool3d(x, *args, ceil_mode=ceil_mode, return_indices=True), randn(1, 2, 7, 6, 5))
    check(lambda x: F.max_pool2d(x, *args, ceil_mode=ceil_mode), randn(3, 9, 8))  # unbatched


def test_max_pool_ties_nan_and_infinity():
    x = torch.tensor([[[[1.0, 3.0, 3.0, NAN], [3.0, 1.0, NAN, 0.0],
                        [-INF, -INF, 2.0, 2.0], [-INF, -INF, 2.0, 2.0]]]])
    # The first maximum wins ties, the last NaN wins, an all -inf window picks its first element.
    same_as_cpu(lambda v: F.max_pool2d(v, 2, 2, return_indices=True), x)
    same_as_cpu(lambda v: F.max_pool2d(v, 3, 1, 1, return_indices=True), x)
    same_as_cpu(lambda v: F.adaptive_max_pool2d(v, 3, return_indices=True), x)


def test_max_pool_integers_and_bf16():
    ints = torch.randint(-5, 5, (2, 3, 6, 6), generator=GEN)
    same_as_cpu(lambda v: F.max_pool2d(v, 2, return_indices=True), ints)
    same_as_cpu(lambda v: F.max_pool2d(v, 3, 2, 1), randn(2, 3, 6, 6).bfloat16())


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [(3, 2, 1, False), (3, 2, 1, True), (2, 3, 1, True)])
@pytest.mark.parametrize("count_include_pad", [False, True])
def test_avg_pool(kernel, stride, padding, ceil_mode, count_include_pad):
    kw = dict(ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    check(lambda x: F.avg_pool1d(x, kernel, stride, padding, **kw), randn(2, 3, 9))
    check(lambda x: F.avg_pool2d(x, kernel, stride, padding, **kw), randn(2, 3, 9, 8))
    check(lambda x: F.avg_pool3d(x, kernel, stride, padding, **kw), randn(1, 2, 7, 6, 5))


def test_avg_pool_divisor_override_and_bf16():
    check(lambda x: F.avg_pool2d(x, 3, 2, 1, divisor_override=5), randn(2, 3, 9, 8))
    check(lambda x: F.avg_pool3d(x, 2, divisor_override=3), randn(1, 2, 4, 4, 4))
    same_as_cpu(lambda x: F.avg_pool2d(x, 2), randn(2, 3, 8, 8).bfloat16(), exact=False)


@pytest.mark.parametrize("size", [(3, 4), (1, 1), (5, 7)])
def test_adaptive_pools(size):
    x2, x3 = randn(2, 3, 9, 8), randn(1, 2, 7, 6, 5)
    check(lambda x: F.adaptive_avg_pool1d(x, size[0]), x2[0])
    check(lambda x: F.adaptive_avg_pool2d(x, size), x2)
    check(lambda x: F.adaptive_avg_pool3d(x, size + (2,)), x3)
    check(lambda x: F.adaptive_max_pool1d(x, size[0], return_indices=True), x2[0])
    check(lambda x: F.adaptive_max_pool2d(x, size, return_indices=True), x2)
    check(lambda x: F.adaptive_max_pool3d(x, size + (2,), return_indices=True), x3)


@pytest.mark.parametrize("kernel, size", [(2, (4, 3)), (3, (3, 3)), (2, (1, 1))])
def test_fractional_max_pool(kernel, size):
    samples2, samples3 = torch.rand(2, 3, 2, generator=GEN), torch.rand(1, 2, 3, generator=GEN)
    check(lambda x: F.fractional_max_pool2d(x, kernel, output_size=size, return_indices=True,
                                            _random_samples=samples2.to(x.device).double()),
          randn(2, 3, 9, 8))
    check(lambda x: F.fractional_max_pool3d(x, kernel, output_size=size + (2,), return_indices=True,
                                            _random_samples=samples3.to(x.device).double()),
          randn(1, 2, 7, 6, 5))


def test_fractional_max_pool_draws_on_the_device():
    out, indices = F.fractional_max_pool2d(randn(2, 3, 9, 8).to("tpu"), 2, output_size=(4, 3),
                                           return_indices=True)
    assert out.shape == (2, 3, 4, 3) and indices.dtype == torch.int64


def test_max_unpool():
    x = randn(2, 3, 8, 6)
    out, indices = F.max_pool2d(x, 2, return_indices=True)
    same_as_cpu(lambda o, i: F.max_unpool2d(o, i, 2), out, indices)
    out, indices = F.max_pool1d(x[0], 2, return_indices=True)
    same_as_cpu(lambda o, i: F.max_unpool1d(o, i, 2), out, indices)
