"""Loss functions that reach the backend, with their backward ops.

`reduction` is ATen's enum: 0 none, 1 mean, 2 sum. Losses compute in opmath (float32 for
bf16/f16) and round once.

Class targets are indices: a target outside [0, C) other than `ignore_index` cannot raise on the
device without a host sync, so it turns its sample's loss (and gradient) into NaN -- visibly wrong,
never silently dropped or clamped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def _reduce(loss, reduction: int):
    if reduction == MEAN:
        return jnp.mean(loss)
    if reduction == SUM:
        return jnp.sum(loss)
    return loss


def _grad_scale(grad, numel: int, reduction: int):
    """The output gradient as it reaches each element of an elementwise loss."""
    return grad / numel if reduction == MEAN else grad


def _compute(ctx, *xs):
    dtype = opmath(ctx.out_dtype())
    return [None if x is None else x.astype(dtype) for x in xs]


# --- negative log likelihood ------------------------------------------------------------------


def _nll_terms(x, target, weight, ignore_index: int):
    """Per-sample (picked log-probability, weight) with the class axis of `x` moved last.

    Ignored samples get weight 0; samples whose target is out of range pick NaN."""
    classes = x.shape[-1]
    ignored = target == ignore_index
    valid = (target >= 0) & (target < classes)
    index = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(x, index[..., None], -1)[..., 0]
    zero = jnp.zeros((), x.dtype)
    picked = jnp.where(ignored, zero, jnp.where(valid, picked, jnp.nan))
    w = jnp.ones_like(picked) if weight is None else jnp.take(weight, index)
    return picked, jnp.where(ignored, zero, w)


def _class_last(x):
    """Move the class axis (1 for batched input, 0 for a single sample) last."""
    return jnp.moveaxis(x, 1, -1) if x.ndim >= 2 else x


@registry.register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(ctx, x, target, weight, reduction: int, ignore_index: int):
    x, weight = _compute(ctx, x, weight)
    picked, w = _nll_terms(_class_last(x), target, weight, ignore_index)
    loss = -picked * w
    total_weight = jnp.sum(w)
    if reduction == NONE:
        return loss, jnp.zeros(ctx.out_shape(1), total_weight.dtype)
    if reduction == SUM:
        return jnp.sum(loss), total_weight
    return jnp.sum(loss) / total_weight, total_weight


@registry.register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(ctx, grad, x, target, weight, reduction: int, ignore_index: int,
                      total_weight):
    grad, x, weight, total_weight = _compute(ctx, grad, x, weight, total_weight)
    last = _class_last(x)
    picked, w = _nll_terms(last, target, weight, ignore_index)
    scale = -w * (grad / total_weight if reduction == MEAN else grad)
    scale = jnp.where(jnp.isnan(picked), jnp.nan, scale)
    onehot = jax.nn.one_hot(jnp.where(target == ignore_index, 0, target), last.shape[-1],
                            dtype=x.dtype)
    out = onehot * scale[..., None]
    return jnp.moveaxis(out, -1, 1) if x.ndim >= 2 else out


# --- elementwise regression losses ------------------------------------------------------------


@registry.register(aten.mse_loss.default)
def mse_loss(ctx, x, target, reduction: int = MEAN):
    x, target = _compute(ctx, x, target)
    return _reduce(jnp.square(x - target), reduction)


@registry.register(aten.mse_loss_backward.default)
def mse_loss_backward(ctx, grad, x, target, reduction: int):
    grad, x, target = _compute(ctx, grad, x, target)
    diff = x - target
    return jnp.broadcast_to(2 * diff * _grad_scale(grad, diff.size, reduction), x.shape)


def _smooth_l1(diff, beta: float):
    z = jnp.abs(diff)
    if beta == 0:
        return z
    return jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)


@registry.register(aten.smooth_l1_loss.default)
def smooth_l1_loss(ctx, x, target, reduction: int = MEAN, beta: float = 1.0):
    x, target = _compute(ctx, x, target)
    return _reduce(_smooth_l1(x - target, beta), reduction)


@registry.register(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(ctx, grad, x, target, reduction: int, beta: float):
    grad, x, target = _compute(ctx, grad, x, target)
    diff = x - target
    slope = jnp.sign(diff) if beta == 0 else jnp.clip(diff / beta, -1, 1)
    return jnp.broadcast_to(slope * _grad_scale(grad, diff.size, reduction), x.shape)


@registry.register(aten.huber_loss.default)
def huber_loss(ctx, x, target, reduction: int = MEAN, delta: float = 1.0):
    # Huber is smooth L1 scaled by delta: delta * smooth_l1(diff, beta=delta).
    x, target = _compute(ctx, x, target)
    return _reduce(delta * _smooth_l1(x - target, delta), reduction)


@registry.register(aten.huber_loss_backward.default)
def huber_loss_backward(ctx, grad, x, target, reduction: int, delta: float):
    grad, x, target = _compute(ctx, grad, x, target)
    diff = x - target
    slope = jnp.clip(diff, -delta, delta)
    return jnp.broadcast_to(slope * _grad_scale(grad, diff.size, reduction), x.shape)


# --- binary cross entropy ---------------------------------------------------------------------

_LOG_FLOOR = -100.0  # PyTorch clamps log terms at -100 so that p = 0 or 1 give finite losses
_BCE_EPSILON = 1e-12


@registry.register(aten.binary_cross_entropy.default)
def binary_cross_entropy(ctx, x, target, weight=None, reduction: int = MEAN):
    x, target, weight = _compute(ctx, x, target, weight)
    log_p = jnp.maximum(jnp.log(x), _LOG_FLOOR)
    log_q = jnp.maximum(jnp.log1p(-x), _LOG_FLOOR)
    loss = (target - 1) * log_q - target * log_p
    return _reduce(loss if weight is None else loss * weight, reduction)


@registry.register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(ctx, grad, x, target, weight=None, reduction: int = MEAN):
    grad, x, target, weight = _compute(ctx, grad, x, target, weight)
    out = (x - target) / jnp.maximum((1 - x) * x, _BCE_EPSILON)
    out = out * _grad_scale(grad, x.size, reduction)
    return out if weight is None else out * weight


@registry.register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(ctx, x, target, weight=None, pos_weight=None,
                                     reduction: int = MEAN):
    x, target, weight, pos_weight = _compute(ctx, x, target, weight, pos_weight)
    log_sigmoid = jnp.minimum(x, 0) - jnp.log1p(jnp.exp(-jnp.abs(x)))
    log_weight = 1 if pos_weight is None else (pos_weight - 1) * target + 1
    loss = (1 - target) * x - log_weight * log_sigmoid
    return _reduce(loss if weight is None else loss * weight, reduction)


# --- margin losses ----------------------------------------------------------------------------


def _as_batch(x, target, target_dims: int):
    """A single sample (C,) or a 0-dim input (one class) as a batch of one; the target gets
    `target_dims` dims (1 for class indices, 2 for multilabel lists)."""
    if x.ndim <= 1:
        return x.reshape(1, -1), target.reshape((1,) + (-1,) * (target_dims - 1))
    return x, target


def _multi_margin_terms(x, target, p: int, margin: float, weight):
    """Per (sample, class) hinge terms max(0, margin - x[y] + x[j]) for j != y, and their
    derivative with respect to x[j], both already divided by C and weighted by weight[y]."""
    classes = x.shape[-1]
    valid = (target >= 0) & (target < classes)
    index = jnp.where(valid, target, 0)
    onehot = jax.nn.one_hot(index, classes, dtype=x.dtype)
    z = margin - jnp.sum(x * onehot, -1, keepdims=True) + x
    active = (z > 0) & (onehot == 0)
    hinge = jnp.where(active, z if p == 1 else z * z, 0)
    slope = jnp.where(active, 1 if p == 1 else 2 * z, 0)
    scale = jnp.where(valid, 1.0, jnp.nan)[:, None] / classes
    if weight is not None:
        scale = scale * jnp.take(weight, index)[:, None]
    return hinge * scale, slope * scale, onehot


@registry.register(aten.multi_margin_loss.default)
def multi_margin_loss(ctx, x, target, p=1, margin=1, weight=None, reduction: int = MEAN):
    x, weight = _compute(ctx, x, weight)
    x, target = _as_batch(x, target, 1)
    hinge, _, _ = _multi_margin_terms(x, target, p, margin, weight)
    loss = jnp.sum(hinge, -1)
    # Unreduced, the loss takes the target's shape (a 0-dim target for a single sample).
    return loss.reshape(ctx.out_shape()) if reduction == NONE else _reduce(loss, reduction)


@registry.register(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(ctx, grad, x, target, p, margin, weight=None,
                               reduction: int = MEAN):
    shape = x.shape
    grad, x, weight = _compute(ctx, grad, x, weight)
    x, target = _as_batch(x, target, 1)
    _, slope, onehot = _multi_margin_terms(x, target, p, margin, weight)
    dx = slope - onehot * jnp.sum(slope, -1, keepdims=True)
    g = grad / x.shape[0] if reduction == MEAN else grad
    g = g.reshape(-1, 1) if reduction == NONE else g
    return (dx * g).reshape(shape)


def _multilabel_terms(x, target):
    """(is_target (N, C), active (N, K, C)): a target list ends at its first -1; term (k, j)
    is active where 1 - x[t_k] + x[j] > 0 for a valid t_k and a non-target class j."""
    classes = x.shape[-1]
    listed = jnp.cumprod(target != -1, -1).astype(bool)
    onehot = jax.nn.one_hot(jnp.where(listed, target, -1), classes, dtype=x.dtype)
    is_target = jnp.any(onehot > 0, -2)
    picked = jnp.sum(onehot * x[..., None, :], -1)  # x[t_k], (N, K)
    z = 1 - picked[..., :, None] + x[..., None, :]
    active = (z > 0) & listed[..., :, None] & ~is_target[..., None, :]
    return is_target, jnp.where(active, z, 0), active.astype(x.dtype), onehot


@registry.register(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(ctx, x, target, reduction: int):
    (x,) = _compute(ctx, x)
    x2, t2 = _as_batch(x, target, 2)
    is_target, hinge, _, _ = _multilabel_terms(x2, t2)
    loss = jnp.sum(hinge, (-2, -1)) / x2.shape[-1]
    # Unreduced, a single sample's loss takes the shape PyTorch's meta kernel gives it: (1,),
    # where the CPU kernel returns a 0-dim tensor.
    loss = loss.reshape(ctx.out_shape()) if reduction == NONE else _reduce(loss, reduction)
    return loss, is_target.reshape(ctx.out_shape(1)).astype(ctx.out_dtype(1))


@registry.register(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(ctx, grad, x, target, reduction: int, is_target):
    grad, x = _compute(ctx, grad, x)
    x2, t2 = _as_batch(x, target, 2)
    _, _, active, onehot = _multilabel_terms(x2, t2)
    # d/dx[j] = sum_k active[k, j]; d/dx[t_k] = -sum_j active[k, j]; all over C.
    dx = jnp.sum(active, -2) - jnp.sum(onehot * jnp.sum(active, -1)[..., None], -2)
    dx = dx / x2.shape[-1]
    g = grad / x2.shape[0] if reduction == MEAN else grad
    g = g.reshape(-1, 1) if reduction == NONE else g
    return (dx * g).reshape(x.shape)


# --- weight norm ------------------------------------------------------------------------------


@registry.register(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(ctx, grad_w, saved_v, saved_g, saved_norms, dim: int):
    """Gradients of w = g * v / ||v|| (norm over every axis but `dim`) for v and g."""
    grad_w, v, g, norms = _compute(ctx, grad_w, saved_v, saved_g, saved_norms)
    # dim == -1 normalises over the whole tensor.
    axes = tuple(a for a in range(v.ndim) if dim == -1 or a != dim)
    dot = jnp.sum(grad_w * v, axes, keepdims=True)
    grad_g = dot / norms
    grad_v = (g / norms) * (grad_w - v * (dot / jnp.square(norms)))
    return grad_v, grad_g
