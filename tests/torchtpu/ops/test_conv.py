"""Convolution on `tpu` against PyTorch's CPU kernels: 1d/2d/3d, stride, padding (also 'same'),
dilation, groups, transposed with output_padding, unbatched and channels-last inputs, bf16,
`convolution_backward` for every output mask, and col2im (fold). Gradient checks run in
float64, where no precision mode applies; float32 runs at `highest`."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401
from value_and_grad import Draws

aten = torch.ops.aten
DRAWS = Draws(0)
GEN, randn = DRAWS.generator, DRAWS.randn



CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
# (stride, padding, dilation, groups)
SETTINGS = [(1, 0, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (3, 1, 2, 2)]


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("stride, padding, dilation, groups", SETTINGS)
def test_conv(dim, stride, padding, dilation, groups):
    x = randn(2, 4, *(7,) * dim)
    w, b = randn(6, 4 // groups, *(3,) * dim), randn(6)
    fn = lambda x, w, b: CONV[dim](x, w, b, stride, padding, dilation, groups)  # noqa: E731
    same_as_cpu(fn, x, w, b, exact=False)
    grads_same_as_cpu(fn, x, w, b)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("stride, padding, dilation, groups", SETTINGS)
def test_conv_transpose(dim, stride, padding, dilation, groups):
    x = randn(2, 4, *(5,) * dim)
    w, b = randn(4, 6 // groups, *(3,) * dim), randn(6)
    output_padding = stride - 1
    fn = lambda x, w, b: CONV_T[dim](x, w, b, stride, padding, output_padding, groups, dilation)  # noqa: E731
    same_as_cpu(fn, x, w, b, exact=False)
    grads_same_as_cpu(fn, x, w, b)


@pytest.mark.parametrize("mask", list(itertools.product([False, True], repeat=3)))
@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_backward_output_mask(mask, transposed):
    x = randn(2, 4, 6, 5)
    w = randn(4, 3, 2, 3) if transposed else randn(3, 4, 2, 3)
    args = ([2, 1], [1, 0], [1, 2], transposed, [1, 0] if transposed else [0, 0], 1)
    grad = aten.convolution(x, w, None, *args)
    grad = randn(*grad.shape)
    same_as_cpu(lambda g, x, w: aten.convolution_backward(g, x, w, [3], *args, list(mask)),
                grad, x, w, exact=False)


def test_padding_same_and_unbatched_input():
    w = randn(5, 3, 4, 3)  # an even kernel needs asymmetric 'same' padding
    same_as_cpu(lambda x, w: F.conv2d(x, w, padding="same", dilation=2), randn(2, 3, 9, 8), w,
                exact=False)
    same_as_cpu(lambda x, w: F.conv2d(x, w, padding=1), randn(3, 9, 8), w, exact=False)


def test_channels_last_and_non_contiguous():
    x = randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = randn(4, 3, 3, 3).transpose(2, 3)
    assert not w.is_contiguous()
    same_as_cpu(lambda x, w: F.conv2d(x, w, stride=2), x, w, exact=False)


def test_float32_at_highest_precision_and_bf16():
    x, w, b = randn(2, 3, 9, 9).float(), randn(8, 3, 3, 3).float(), randn(8).float()
    with torch.tpu.precision("highest"):
        same_as_cpu(lambda x, w, b: F.conv2d(x, w, b, padding=1), x, w, b, exact=False)
    # bf16: products accumulate in fp32 and round once, as PyTorch's CPU kernel does.
    same_as_cpu(lambda x, w, b: F.conv2d(x, w, b, padding=1), x.bfloat16(), w.bfloat16(),
                b.bfloat16(), exact=False)


def test_bad_shapes_raise():
    with pytest.raises(RuntimeError, match="channel"):
        F.conv2d(torch.zeros(1, 3, 5, 5, device="tpu"), torch.zeros(4, 2, 3, 3, device="tpu"))


@pytest.mark.parametrize(
    "kernel, dilation, padding, stride",
    [((2, 3), (1, 1), (0, 0), (1, 1)), ((3, 3), (2, 1), (1, 2), (2, 1)), ((2, 2), (1, 1), (1, 1), (3, 2))],
)
def test_fold(kernel, dilation, padding, stride):
    cols = F.unfold(randn(2, 3, 9, 8), kernel, dilation, padding, stride)
    fold = lambda c: F.fold(c, (9, 8), kernel, dilation, padding, stride)  # noqa: E731
    same_as_cpu(fold, cols)
    same_as_cpu(fold, cols[0])  # unbatched
    same_as_cpu(fold, cols[:0])  # empty batch
    grads_same_as_cpu(fold, cols)
