"""Softmax and normalisation layers (layer, group, batch norm), with their backward ops.

Everything computes in opmath (float32 for bf16/f16 inputs) and rounds once, as PyTorch's CPU
kernels do. The saved statistics (mean, rstd) come out in the dtype ATen's CPU kernels give them
(`statistics_dtype`): PyTorch's meta kernels follow its CUDA kernels instead (float32 for every
bf16/f16 input, per-channel statistics in evaluation mode), so the lowerings carry `meta=` rules.

The three norms share their math: statistics over some axes of `x`, `xhat = (x - mean) * rstd`,
and the same backward, `rstd * (g - mean(g) - xhat * mean(g * xhat))` over the normalised
axes, where `g` is the output gradient times the affine weight.

`_native_batch_norm_legit.default` (Core ATen) mutates its running statistics and returns fresh
tensors; the executors cannot yet map it onto its functional sibling
`_native_batch_norm_legit_functional`, which is lowered here, so that one overload still runs as
PyTorch's decomposition (see docs/lowerings.md).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import torch
from jax import lax
from torch._prims_common import canonicalize_dim, get_computation_dtype

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


# --- softmax ----------------------------------------------------------------------------------


def _softmax_input(ctx, x):
    return x.astype(opmath(ctx.out_dtype()))


def _shifted(x, dim: int):
    """x minus its maximum along `dim` (a row of -inf gives NaN, as in PyTorch)."""
    if x.ndim == 0:
        return x - x
    return x - lax.stop_gradient(jnp.max(x, _dim(x, dim), keepdims=True))


def _sum(x, dim: int):
    return x if x.ndim == 0 else jnp.sum(x, _dim(x, dim), keepdims=True)


def _dim(x, dim: int) -> int:
    """`dim` wrapped into range; PyTorch's IndexError otherwise (its meta kernels let it pass)."""
    return canonicalize_dim(x.ndim, dim)


@registry.register(aten._softmax.default)
def softmax(ctx, x, dim: int, half_to_float: bool):
    e = jnp.exp(_shifted(_softmax_input(ctx, x), dim))
    return e / _sum(e, dim)


@registry.register(aten._log_softmax.default)
def log_softmax(ctx, x, dim: int, half_to_float: bool):
    shifted = _shifted(_softmax_input(ctx, x), dim)
    return shifted - jnp.log(_sum(jnp.exp(shifted), dim))


@registry.register(aten._safe_softmax.default)
def safe_softmax(ctx, x, dim: int, dtype=None):
    """Softmax whose rows of -inf (fully masked attention rows) give 0 instead of NaN."""
    x = _softmax_input(ctx, x)
    e = jnp.exp(_shifted(x, dim))
    masked = jnp.all(x == -jnp.inf, _dim(x, dim), keepdims=True) if x.ndim else x == -jnp.inf
    return jnp.where(masked, jnp.zeros((), x.dtype), e / _sum(e, dim))


@registry.register(aten._softmax_backward_data.default)
def softmax_backward(ctx, grad, out, dim: int, input_dtype):
    compute = opmath(ctx.out_dtype())
    grad, out = grad.astype(compute), out.astype(compute)
    return out * (grad - _sum(grad * out, dim))


@registry.register(aten._log_softmax_backward_data.default)
def log_softmax_backward(ctx, grad, out, dim: int, input_dtype):
    compute = opmath(ctx.out_dtype())
    grad, out = grad.astype(compute), out.astype(compute)
    return grad - jnp.exp(out) * _sum(grad, dim)


# --- shared normalisation math ----------------------------------------------------------------


def _moments(x, axes: tuple[int, ...]):
    """(mean, biased variance) of `x` over `axes`, kept as size-1 axes."""
    mean = jnp.mean(x, axes, keepdims=True)
    return mean, jnp.mean(jnp.square(x - mean), axes, keepdims=True)


def _statistics(x, axes: tuple[int, ...], eps: float):
    """(mean, rstd) of `x` over `axes`, as the norms normalise with."""
    mean, var = _moments(x, axes)
    return mean, lax.rsqrt(var + eps)


def _normalized_grad(g, xhat, rstd, axes: tuple[int, ...]):
    """Input gradient of `xhat = (x - mean(x)) * rstd(x)` over `axes`, given `g = dL/dxhat`."""
    mean_g = jnp.mean(g, axes, keepdims=True)
    mean_gx = jnp.mean(g * xhat, axes, keepdims=True)
    return rstd * (g - mean_g - xhat * mean_gx)


def _affine(x, weight, bias, shape: tuple[int, ...]):
    """x * weight + bias, with weight and bias reshaped to `shape` for broadcasting."""
    if weight is not None:
        x = x * weight.astype(x.dtype).reshape(shape)
    if bias is not None:
        x = x + bias.astype(x.dtype).reshape(shape)
    return x


def _affine_grads(grad, xhat, axes: tuple[int, ...], output_mask: Sequence[bool]):
    """(grad_weight, grad_bias) of `xhat * weight + bias`, summed over the axes the affine
    parameters are broadcast along; None where `output_mask` does not ask for them."""
    grad_weight = jnp.sum(grad * xhat, axes) if output_mask[1] else None
    grad_bias = jnp.sum(grad, axes) if output_mask[2] else None
    return grad_weight, grad_bias


def _empty_like_out(ctx, index: int):
    return jnp.zeros(ctx.out_shape(index), ctx.out_dtype(index))


def statistics_dtype(x: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """The dtype of the statistics (mean, rstd) ATen's CPU norm kernels save for input `x` with
    affine and running parameters `params`: x's own dtype, unless the first parameter given has
    another one (ATen's "mixed type": a bf16/f16 input with float32 parameters), then x's opmath
    dtype. Statistics are computed in opmath either way and rounded once."""
    first = next((p for p in params if p is not None), None)
    if first is not None and first.dtype != x.dtype:
        return get_computation_dtype(x.dtype)
    return x.dtype


def cpu_saved_statistics(x, mean, rstd, training: bool, *params):
    """(save_mean, save_rstd) of a batch norm as ATen's CPU kernel returns them: in
    `statistics_dtype`, and empty in evaluation mode (PyTorch's meta kernels and decompositions
    give per-channel tensors there, as its CUDA kernels do)."""
    dtype = statistics_dtype(x, *params)
    if not training:
        return mean.new_empty(0, dtype=dtype), rstd.new_empty(0, dtype=dtype)
    return mean.to(dtype), rstd.to(dtype)


# --- layer norm -------------------------------------------------------------------------------


def _layer_axes(x, normalized_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


def _layer_norm_meta(x, normalized_shape, weight, bias, eps):
    out, mean, rstd = aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)
    dtype = statistics_dtype(x, weight, bias)
    return out, mean.to(dtype), rstd.to(dtype)


@registry.register(aten.native_layer_norm.default, meta=_layer_norm_meta)
def native_layer_norm(ctx, x, normalized_shape, weight, bias, eps: float):
    axes = _layer_axes(x, normalized_shape)
    x = x.astype(opmath(x.dtype))
    mean, rstd = _statistics(x, axes, eps)
    out = _affine((x - mean) * rstd, weight, bias, tuple(normalized_shape))
    return out, mean, rstd


@registry.register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(
    ctx, grad, x, normalized_shape, mean, rstd, weight, bias, output_mask: Sequence[bool]
):
    axes = _layer_axes(x, normalized_shape)
    batch = tuple(range(x.ndim - len(normalized_shape)))
    compute = opmath(x.dtype)
    grad, x = grad.astype(compute), x.astype(compute)
    xhat = (x - mean.astype(compute)) * rstd.astype(compute)
    g = grad if weight is None else grad * weight.astype(compute)
    grad_input = _normalized_grad(g, xhat, rstd.astype(compute), axes) if output_mask[0] else None
    mask = (output_mask[0], output_mask[1] and weight is not None, output_mask[2] and bias is not None)
    return (grad_input, *_affine_grads(grad, xhat, batch, mask))


# --- group norm -------------------------------------------------------------------------------


def _grouped(x, n: int, group: int):
    """(N, C, *) -> (N, group, C/group * spatial): statistics run over the last axis."""
    return x.reshape(n, group, -1)


def _per_channel(c: int, ndim: int) -> tuple[int, ...]:
    return (1, c) + (1,) * (ndim - 2)


def _batch_axes(x) -> tuple[int, ...]:
    """Every axis but the channels (1): what per-channel parameters are broadcast along."""
    return (0,) + tuple(range(2, x.ndim))


@registry.register(aten.native_group_norm.default)
def native_group_norm(ctx, x, weight, bias, n: int, c: int, hxw: int, group: int, eps: float):
    compute = opmath(x.dtype)
    grouped = _grouped(x.astype(compute), n, group)
    mean, rstd = _statistics(grouped, (2,), eps)
    out = ((grouped - mean) * rstd).reshape(x.shape)
    out = _affine(out, weight, bias, _per_channel(c, x.ndim))
    return out, mean.reshape(n, group), rstd.reshape(n, group)


@registry.register(aten.native_group_norm_backward.default)
def native_group_norm_backward(
    ctx, grad, x, mean, rstd, weight, n: int, c: int, hxw: int, group: int,
    output_mask: Sequence[bool],
):
    compute = opmath(x.dtype)
    grad, x = grad.astype(compute), x.astype(compute)
    stat_shape = (n, group, 1)
    rstd = rstd.astype(compute).reshape(stat_shape)
    xhat = ((_grouped(x, n, group) - mean.astype(compute).reshape(stat_shape)) * rstd)
    xhat = xhat.reshape(x.shape)
    g = grad if weight is None else grad * weight.astype(compute).reshape(_per_channel(c, x.ndim))
    grad_input = None
    if output_mask[0]:
        grad_input = _normalized_grad(
            _grouped(g, n, group), _grouped(xhat, n, group), rstd, (2,)
        ).reshape(x.shape)
    return (grad_input, *_affine_grads(grad, xhat, _batch_axes(x), output_mask))


# --- batch norm -------------------------------------------------------------------------------


def _batch_norm_train(x, weight, bias, eps: float):
    """(out, mean, rstd, biased variance) with per-channel batch statistics."""
    x = x.astype(opmath(x.dtype))
    mean, var = _moments(x, _batch_axes(x))
    rstd = lax.rsqrt(var + eps)
    out = _affine((x - mean) * rstd, weight, bias, _per_channel(x.shape[1], x.ndim))
    return out, mean.reshape(-1), rstd.reshape(-1), var.reshape(-1)


def _updated_running(running, batch_value, momentum: float):
    """The new running statistic, computed in opmath and rounded once to the running dtype."""
    compute = opmath(running.dtype)
    updated = (1 - momentum) * running.astype(compute) + momentum * batch_value.astype(compute)
    return updated.astype(running.dtype)


def _batch_norm_functional_meta(x, weight, bias, running_mean, running_var, training, momentum, eps):
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, training, momentum, eps)
    saved = cpu_saved_statistics(x, mean, rstd, training, weight, bias, running_mean, running_var)
    return out, *saved, new_mean.to(running_mean.dtype), new_var.to(running_var.dtype)


def _batch_norm_no_stats_meta(x, weight, bias, training, momentum, eps):
    out, mean, rstd = aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)
    return out, *cpu_saved_statistics(x, mean, rstd, training, weight, bias)


def _batch_norm_no_training_meta(x, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, rstd = aten._native_batch_norm_legit_no_training.default(
        x, weight, bias, running_mean, running_var, momentum, eps)
    return out, *cpu_saved_statistics(x, mean, rstd, False, weight, bias, running_mean, running_var)


@registry.register(aten._native_batch_norm_legit_functional.default, meta=_batch_norm_functional_meta)
def batch_norm_functional(
    ctx, x, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float
):
    if not training:
        out = batch_norm_no_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps)
        return (*out, running_mean, running_var)
    out, mean, rstd, var = _batch_norm_train(x, weight, bias, eps)
    n = x.size // x.shape[1]
    # The running variance is unbiased (n / (n - 1)), as in PyTorch.
    unbiased = var * (n / max(n - 1, 1))
    return (
        out, mean, rstd,
        _updated_running(running_mean, mean, momentum),
        _updated_running(running_var, unbiased, momentum),
    )


@registry.register(aten._native_batch_norm_legit.no_stats, meta=_batch_norm_no_stats_meta)
def batch_norm_no_stats(ctx, x, weight, bias, training: bool, momentum: float, eps: float):
    return _batch_norm_train(x, weight, bias, eps)[:3]


@registry.register(aten._native_batch_norm_legit_no_training.default, meta=_batch_norm_no_training_meta)
def batch_norm_no_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    compute = opmath(x.dtype)
    shape = _per_channel(x.shape[1], x.ndim)
    rstd = lax.rsqrt(running_var.astype(compute) + eps).reshape(shape)
    xhat = (x.astype(compute) - running_mean.astype(compute).reshape(shape)) * rstd
    out = _affine(xhat, weight, bias, shape)
    return out, _empty_like_out(ctx, 1), _empty_like_out(ctx, 2)


def _batch_norm_grad(grad, x, weight, running_mean, running_var, save_mean, save_invstd,
                     train: bool, eps: float, output_mask: Sequence[bool]):
    compute = opmath(x.dtype)
    grad, x = grad.astype(compute), x.astype(compute)
    shape = _per_channel(x.shape[1], x.ndim)
    axes = _batch_axes(x)
    if train:
        mean, rstd = save_mean.astype(compute), save_invstd.astype(compute)
    else:
        mean, rstd = running_mean.astype(compute), lax.rsqrt(running_var.astype(compute) + eps)
    mean, rstd = mean.reshape(shape), rstd.reshape(shape)
    xhat = (x - mean) * rstd
    g = grad if weight is None else grad * weight.astype(compute).reshape(shape)
    grad_input = None
    if output_mask[0]:
        grad_input = _normalized_grad(g, xhat, rstd, axes) if train else g * rstd
    return (grad_input, *_affine_grads(grad, xhat, axes, output_mask))


@registry.register(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(ctx, grad, x, weight, running_mean, running_var, save_mean,
                               save_invstd, train: bool, eps: float, output_mask):
    return _batch_norm_grad(grad, x, weight, running_mean, running_var, save_mean, save_invstd,
                            train, eps, output_mask)


@registry.register(aten.batch_norm_backward.default)
def batch_norm_backward(ctx, grad, x, weight, running_mean, running_var, save_mean, save_var,
                        update: bool, eps: float, output_mask, reserve):
    # `save_var` holds the saved inverse standard deviation, as in native_batch_norm_backward.
    return _batch_norm_grad(grad, x, weight, running_mean, running_var, save_mean, save_var,
                            update, eps, output_mask)
