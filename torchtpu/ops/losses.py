"""Loss functions that reach the backend, with their backward ops.

`reduction` is ATen's enum: 0 none, 1 mean, 2 sum. Losses compute in opmath (float32 for
bf16/f16) and round once.

Class targets are indices: a target outside [0, C) other than `ignore_index` cannot raise on the
device without a host sync, so it turns its sample's loss (and gradient) into NaN -- visibly wrong,
never silently dropped or clamped.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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


# --- connectionist temporal classification ----------------------------------------------------
# ATen's CTC: alpha (forward) and beta (backward) recursions in log space over the extended
# label sequence l' = (blank, t1, blank, t2, ..., blank), one lax.scan over time each. The
# backward op returns ATen's gradient, exp(lp) - exp(log(sum alpha*beta) + nll - lp): the
# gradient with respect to the logits under log_softmax, which ATen's autograd expects.

_NEG_INF = -jnp.inf


def _padded_targets(targets, target_lengths: np.ndarray):
    """Targets as (N, S), S the longest target: padded 2-d targets cut to S columns,
    concatenated 1-d targets split per sample (padding entries are never read)."""
    width = max(int(target_lengths.max(initial=0)), 1)
    if targets.ndim == 2:
        return targets[:, :width] if targets.shape[1] >= width else jnp.pad(
            targets, ((0, 0), (0, width - targets.shape[1])))
    starts = np.concatenate([[0], np.cumsum(target_lengths)[:-1]]).astype(np.int64)
    index = starts[:, None] + np.arange(width)[None, :]
    return targets[np.clip(index, 0, max(targets.shape[0] - 1, 0))]


class _Ctc(NamedTuple):
    emissions: jax.Array  # (T, N, S') log-probability of each extended label at each time
    labels: jax.Array  # (N, S') extended labels
    skip: jax.Array  # (N, S') the label two back may be skipped (alpha) / to (beta)
    valid: jax.Array  # (N, S') s <= 2 * target_length
    input_lengths: np.ndarray  # (N,)
    target_lengths: np.ndarray  # (N,)


def _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank: int) -> _Ctc:
    n = log_probs.shape[1]
    target_lengths = np.asarray(target_lengths, np.int64).reshape(n)
    padded = _padded_targets(targets, target_lengths)
    width = 2 * padded.shape[1] + 1
    s = jnp.arange(width)
    labels = jnp.where(s % 2 == 0, blank, padded[:, jnp.clip((s - 1) // 2, 0, padded.shape[1] - 1)])
    emissions = jnp.take_along_axis(log_probs, jnp.broadcast_to(labels, (log_probs.shape[0],) + labels.shape), -1)
    previous = jnp.concatenate([jnp.full((n, 2), -1, labels.dtype), labels[:, :-2]], 1)
    return _Ctc(
        emissions,
        labels,
        (s % 2 == 1) & (s >= 2) & (labels != previous),
        s <= 2 * target_lengths[:, None],
        np.asarray(input_lengths, np.int64).reshape(n),
        target_lengths,
    )


def _shift(x, by: int):
    """x[..., s - by] along the last axis (-inf where s < by)."""
    return jnp.concatenate([jnp.full(x.shape[:-1] + (by,), _NEG_INF, x.dtype), x[..., :-by]], -1)


def _log_add(*terms):
    total = terms[0]
    for term in terms[1:]:
        total = jnp.logaddexp(total, term)
    return total


def _ctc_alpha(ctc: _Ctc):
    """(log_alpha (N, T, S'), negative log-likelihood (N,))."""
    neg_inf = jnp.full(ctc.valid.shape, _NEG_INF, ctc.emissions.dtype)
    first = jnp.where(jnp.arange(ctc.valid.shape[1]) < 2, ctc.emissions[0], _NEG_INF)
    first = jnp.where(ctc.valid, first, _NEG_INF)

    def step(alpha, inputs):
        t, emission = inputs
        skip = jnp.where(ctc.skip, _shift(alpha, 2), _NEG_INF)
        new = jnp.where(ctc.valid, _log_add(alpha, _shift(alpha, 1), skip) + emission, _NEG_INF)
        live = (t < ctc.input_lengths)[:, None]
        return jnp.where(live, new, alpha), jnp.where(live, new, neg_inf)

    times = jnp.arange(1, ctc.emissions.shape[0])
    last, rows = lax.scan(step, first, (times, ctc.emissions[1:]))
    log_alpha = jnp.concatenate([jnp.where((ctc.input_lengths > 0)[:, None], first, neg_inf)[None], rows])
    end = 2 * ctc.target_lengths
    final = jnp.take_along_axis(last, end[:, None], 1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(end - 1, 0)[:, None], 1)[:, 0]
    before = jnp.where(ctc.target_lengths > 0, before, _NEG_INF)
    return jnp.moveaxis(log_alpha, 0, 1), -_log_add(final, before)


@registry.register(aten._ctc_loss.default)
def ctc_loss(ctx, log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    (log_probs,) = _compute(ctx, log_probs)
    log_alpha, nll = _ctc_alpha(_ctc_setup(log_probs, targets, input_lengths, target_lengths, blank))
    return nll, log_alpha


@registry.register(aten._ctc_loss_backward.default)
def ctc_loss_backward(ctx, grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha,
                      blank, zero_infinity=False):
    grad, log_probs, nll, log_alpha = _compute(ctx, grad, log_probs, nll, log_alpha)
    ctc = _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank)
    end = 2 * ctc.target_lengths[:, None]
    s = jnp.arange(ctc.valid.shape[1])
    neg_inf = jnp.full(ctc.valid.shape, _NEG_INF, log_probs.dtype)
    # beta's skip: from s to s + 2 when l'(s + 2) differs from l'(s).
    skip_ahead = jnp.concatenate([ctc.skip[:, 2:], jnp.zeros_like(ctc.skip[:, :2])], 1)

    def step(beta, inputs):
        t, emission = inputs
        later = jnp.concatenate([beta[:, 1:], neg_inf[:, :1]], 1)
        skip = jnp.where(skip_ahead, jnp.concatenate([beta[:, 2:], neg_inf[:, :2]], 1), _NEG_INF)
        new = jnp.where(ctc.valid, _log_add(beta, later, skip) + emission, _NEG_INF)
        start = jnp.where((s == end) | ((s == end - 1) & (end > 0)), emission, _NEG_INF)
        last_step = (t == ctc.input_lengths - 1)[:, None]
        beta = jnp.where(last_step, start, jnp.where((t < ctc.input_lengths - 1)[:, None], new, neg_inf))
        return beta, beta

    times = jnp.arange(log_probs.shape[0])[::-1]
    _, betas = lax.scan(step, neg_inf, (times, ctc.emissions[::-1]))
    log_ab = jnp.moveaxis(log_alpha, 1, 0) + betas[::-1]  # (T, N, S')
    onehot = jax.nn.one_hot(ctc.labels, log_probs.shape[-1], dtype=bool)  # (N, S', C)
    lcab = jax.nn.logsumexp(jnp.where(onehot, log_ab[..., None], _NEG_INF), axis=2)
    out = (jnp.exp(log_probs) - jnp.exp(lcab + nll[:, None] - log_probs)) * grad[:, None]
    live = jnp.arange(log_probs.shape[0])[:, None] < ctc.input_lengths[None, :]
    if zero_infinity:
        live = live & ~jnp.isinf(nll)[None, :]
    return jnp.where(live[..., None], out, jnp.zeros((), out.dtype))


@registry.register_data_dependent(aten._ctc_loss.Tensor)
def ctc_loss_tensor_lengths(log_probs, targets, input_lengths, target_lengths, blank=0,
                            zero_infinity=False):
    """Lengths given as tensors: the outputs' shape depends on the longest target, so the
    lengths are read to the host (one sync, as ATen's CPU and CUDA kernels also do)."""
    return aten._ctc_loss.default(log_probs, targets, input_lengths.tolist(),
                                  target_lengths.tolist(), blank, zero_infinity)


@registry.register_data_dependent(aten._ctc_loss_backward.Tensor)
def ctc_loss_backward_tensor_lengths(grad, log_probs, targets, input_lengths, target_lengths, nll,
                                     log_alpha, blank, zero_infinity=False):
    return aten._ctc_loss_backward.default(grad, log_probs, targets, input_lengths.tolist(),
                                           target_lengths.tolist(), nll, log_alpha, blank,
                                           zero_infinity)
