"""Convolution and its backward, over `lax.conv_general_dilated`, and col2im (fold).

One N-d convolution serves 1d/2d/3d. Every convolution here -- forward, transposed, and both
gradients -- is a contraction, so each goes through `precision.conv_general_dilated` and takes the
TPU precision mode's bf16 passes. The gradients are convolutions themselves:

- the input gradient of a convolution is the transposed convolution of `grad_output` with the
  same weight (and the input gradient of a transposed convolution is a plain convolution);
- the weight gradient correlates the input with `grad_output`, with the roles of batch and
  channels exchanged (`batch_group_count` keeps groups apart); a transposed convolution is the
  adjoint of a plain one, so its weight gradient is the plain one's with input and
  `grad_output` exchanged.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu import precision
from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


def _specs(ndim: int, lhs: tuple[int, int], rhs: tuple[int, int], out: tuple[int, int]):
    """ConvDimensionNumbers from (batch, feature) axes of lhs/out and (out, in) axes of rhs."""
    spatial = tuple(range(2, ndim))
    return lax.ConvDimensionNumbers(lhs + spatial, rhs + spatial, out + spatial)


_PLAIN = ((0, 1), (0, 1), (0, 1))
# Weight gradient: N is contracted (lhs feature / rhs input), input channels become the batch.
_WEIGHT_GRAD = ((1, 0), (1, 0), (1, 0))


def _conv(ctx, lhs, rhs, specs, **conv):
    return precision.conv_general_dilated(
        lhs, rhs, ctx.precision, ctx.platform, opmath(jnp.result_type(lhs, rhs)),
        dimension_numbers=_specs(lhs.ndim, *specs), **conv,
    )


def _plain(ctx, x, w, stride, padding, dilation, groups):
    """PyTorch's convolution: w is (C_out, C_in / groups, *kernel)."""
    return _conv(
        ctx, x, w, _PLAIN, window_strides=tuple(stride), padding=[(p, p) for p in padding],
        rhs_dilation=tuple(dilation), feature_group_count=groups,
    )


def _transposed(ctx, x, w, stride, padding, dilation, output_padding, groups):
    """PyTorch's transposed convolution: w is (C_in, C_out / groups, *kernel). It is the input
    gradient of the plain convolution with that weight: `x` dilated by the stride, correlated
    with the spatially flipped kernel, each group's (in, out) roles swapped."""
    kernel = w.shape[2:]
    c_in, c_out_g = w.shape[0], w.shape[1]
    w = w.reshape(groups, c_in // groups, c_out_g, *kernel).swapaxes(1, 2)
    w = w.reshape(groups * c_out_g, c_in // groups, *kernel)
    w = jnp.flip(w, tuple(range(2, w.ndim)))
    pads = [
        (d * (k - 1) - p, d * (k - 1) - p + r)
        for k, p, d, r in zip(kernel, padding, dilation, output_padding)
    ]
    lhs_dilation = tuple(stride)
    if any(s > 1 for s in stride) and any(d > 1 for d in dilation):
        # XLA's algebraic simplifier aborts on some convolutions with both lhs and rhs
        # dilation (jax 0.10.2): dilate and pad the input explicitly instead.
        x = lax.pad(x, jnp.zeros((), x.dtype),
                    [(0, 0, 0)] * 2 + [(lo, hi, s - 1) for (lo, hi), s in zip(pads, stride)])
        pads, lhs_dilation = [(0, 0)] * len(kernel), (1,) * len(kernel)
    return _conv(
        ctx, x, w, _PLAIN, window_strides=(1,) * len(kernel), padding=pads,
        lhs_dilation=lhs_dilation, rhs_dilation=tuple(dilation), feature_group_count=groups,
    )


def _weight_grad(ctx, x, grad, kernel, stride, padding, dilation, groups):
    """d(plain conv)/d(weight): gw[o, i, k] = sum_{n, t} x[n, i, t*stride + k*dilation - pad] *
    grad[n, o, t], a correlation of x with grad dilated by the stride, sampled every `dilation`."""
    pads = []
    for size, out, k, s, p, d in zip(x.shape[2:], grad.shape[2:], kernel, stride, padding, dilation):
        # The high padding that makes exactly `k` window positions (negative trims x).
        pads.append((p, (k - 1) * d + (out - 1) * s + 1 - size - p))
    return _conv(
        ctx, x, grad, _WEIGHT_GRAD, window_strides=tuple(dilation), padding=pads,
        rhs_dilation=tuple(stride), batch_group_count=groups,
    )


def _with_bias(ctx, out, bias):
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out.astype(ctx.out_dtype())


@registry.register(aten.convolution.default)
def convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        out = _transposed(ctx, x, w, stride, padding, dilation, output_padding, groups)
    else:
        out = _plain(ctx, x, w, stride, padding, dilation, groups)
    return _with_bias(ctx, out, bias)


@registry.register(aten.convolution_backward.default)
def convolution_backward(
    ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
    output_mask: Sequence[bool],
):
    kernel = w.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = _plain(ctx, grad, w, stride, padding, dilation, groups)
        else:
            # The output padding that gives back exactly the input's size.
            extra = [
                size - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
                for size, o, s, p, d, k in zip(
                    x.shape[2:], grad.shape[2:], stride, padding, dilation, kernel
                )
            ]
            grad_input = _transposed(ctx, grad, w, stride, padding, dilation, extra, groups)
        grad_input = grad_input.astype(ctx.out_dtype(0))
    if output_mask[1]:
        if transposed:
            grad_weight = _weight_grad(ctx, grad, x, kernel, stride, padding, dilation, groups)
        else:
            grad_weight = _weight_grad(ctx, x, grad, kernel, stride, padding, dilation, groups)
        grad_weight = grad_weight.astype(ctx.out_dtype(1))
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad.ndim))
        grad_bias = jnp.sum(grad.astype(opmath(grad.dtype)), axes).astype(ctx.out_dtype(2))
    return grad_input, grad_weight, grad_bias


@registry.register(aten.col2im.default)
def col2im(ctx, cols, output_size, kernel_size, dilation, padding, stride):
    """Sum sliding-window columns (N, C * kh * kw, L) back into images (N, C, H, W): each kernel
    offset's (Lh, Lw) block lands on a strided grid of the padded image (an interior-padded
    block), and the blocks add up; overlapping windows accumulate, as in PyTorch."""
    kh, kw = kernel_size
    batch = cols.shape[:-2]
    padded = [size + 2 * p for size, p in zip(output_size, padding)]
    blocks = [
        (size - d * (k - 1) - 1) // s + 1
        for size, k, d, s in zip(padded, kernel_size, dilation, stride)
    ]
    cols = cols.reshape(batch + (cols.shape[-2] // (kh * kw), kh, kw) + tuple(blocks))
    zero = jnp.zeros((), cols.dtype)
    out = None
    for i in range(kh):
        for j in range(kw):
            config = [(0, 0, 0)] * (len(batch) + 1)
            for offset, block, size, s in (
                (i * dilation[0], blocks[0], padded[0], stride[0]),
                (j * dilation[1], blocks[1], padded[1], stride[1]),
            ):
                config.append((offset, size - offset - (block - 1) * s - 1, s - 1))
            placed = lax.pad(cols[..., i, j, :, :], zero, config)
            out = placed if out is None else out + placed
    (ph, pw), (h, w) = padding, output_size
    return out[..., ph: ph + h, pw: pw + w]
