"""Activation functions and the backward ops autograd calls for them.

Each lowering is its PyTorch CPU kernel's formula, computed in float32 for bfloat16 inputs
("opmath"), with the same branch conditions so that NaN and boundary points (x == threshold,
x == +-3 for the hard* functions) take the same side. One program per activation: their
decompositions would run as several programs each in eager mode.

The hyper-parameters (slopes, alphas, thresholds, bounds) are traced scalars: changing one does
not recompile.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.promotion import DEFAULT, pointwise

aten = torch.ops.aten

_SQRT1_2 = 1 / math.sqrt(2)
_GELU_PDF = 0.5 * (2 / math.sqrt(math.pi)) * _SQRT1_2  # 1 / sqrt(2 pi)
_GELU_TANH_BETA = math.sqrt(2) * (2 / math.sqrt(math.pi)) * 0.5  # sqrt(2 / pi)
_GELU_TANH_KAPPA = 0.044715


def activation(*ops):
    """Register a forward activation of `self` (computed in opmath, result in self's dtype)."""
    return pointwise(*ops, promotion=DEFAULT, operands=("self",))


def gradient(*ops, operands=("grad_output", "self"), outputs=1):
    """Register a backward op over `operands` (the incoming gradient and the saved tensor).
    Ops with several `outputs` return them in the computation dtype; the executor casts each."""
    return pointwise(*ops, promotion=DEFAULT, operands=operands, keep_result_dtype=outputs > 1)


def _like(value, x):
    return jnp.asarray(value, x.dtype)


def _zero(x):
    return jnp.zeros_like(x)


# --- rectifiers ----------------------------------------------------------------------------------


@activation(aten.relu.default)
def relu(ctx, x):
    return jnp.maximum(x, _zero(x))


@activation(aten.threshold.default)
def threshold(ctx, x, threshold, value):
    return jnp.where(x <= _like(threshold, x), _like(value, x), x)


@gradient(aten.threshold_backward.default)
def threshold_backward(ctx, grad, x, threshold):
    return jnp.where(x <= _like(threshold, x), _zero(grad), grad)


@activation(aten.hardtanh.default)
def hardtanh(ctx, x, min_val=-1, max_val=1):
    return jnp.minimum(jnp.maximum(x, _like(min_val, x)), _like(max_val, x))


@gradient(aten.hardtanh_backward.default)
def hardtanh_backward(ctx, grad, x, min_val, max_val):
    return jnp.where((x <= min_val) | (x >= max_val), _zero(grad), grad)


@activation(aten.leaky_relu.default)
def leaky_relu(ctx, x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * _like(negative_slope, x))


@gradient(aten.leaky_relu_backward.default)
def leaky_relu_backward(ctx, grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * _like(negative_slope, grad))


@registry.register(aten.rrelu_with_noise_functional.default, dynamic_scalars=True, random=True)
def rrelu_with_noise_functional(ctx, x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """Randomized leaky ReLU: in training, negative inputs get a slope drawn uniformly from
    [lower, upper] (returned as the new noise; 1 for positive inputs); otherwise the mean slope.
    (`rrelu_with_noise`, which mutates `noise`, is the same op in place.)"""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    value = x.astype(compute)
    if not training:
        return jnp.where(value > 0, value, value * ((lower + upper) / 2)), noise
    drawn = jax.random.uniform(ctx.rng_key(), x.shape, compute, minval=lower, maxval=upper)
    slope = jnp.where(value > 0, jnp.ones_like(value), drawn)
    return value * slope, slope


@registry.register_data_dependent(aten.rrelu_with_noise.default)
def rrelu_with_noise(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """`rrelu_with_noise` writes its `noise` argument but has no trailing underscore, so the
    executors cannot derive it from its functional form as they do for in-place ops. This
    kernel over `tpu` tensors runs the functional form and writes the noise back (in training,
    where PyTorch writes it)."""
    out, drawn = aten.rrelu_with_noise_functional(x, noise, lower, upper, training, generator=generator)
    if training:
        noise.copy_(drawn)
    return out


@registry.register_data_dependent(aten.rrelu_with_noise_.default)
def rrelu_with_noise_(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """In place on `x` too (its functional form is `rrelu_with_noise`, itself mutating)."""
    return x.copy_(rrelu_with_noise(x, noise, lower, upper, training, generator))


@gradient(aten.rrelu_with_noise_backward.default, operands=("grad_output", "self", "noise"))
def rrelu_with_noise_backward(ctx, grad, x, noise, lower, upper, training, self_is_result):
    slope = jnp.where(x > 0, jnp.ones_like(grad), _like((lower + upper) / 2, grad))
    if training:
        slope = jnp.where(_like(upper - lower, grad) > 1e-6, noise, slope)
    return grad * slope


@pointwise(aten._prelu_kernel.default, promotion=DEFAULT, operands=("self", "weight"))
def prelu_kernel(ctx, x, weight):
    return jnp.where(x > 0, x, weight * x)


@gradient(aten._prelu_kernel_backward.default, operands=("grad_output", "self", "weight"), outputs=2)
def prelu_kernel_backward(ctx, grad, x, weight):
    positive = x > 0
    return jnp.where(positive, grad, weight * grad), jnp.where(positive, _zero(x), x * grad)


# --- exponential units ---------------------------------------------------------------------------


def _elu(x, alpha, scale, input_scale):
    negative = jnp.expm1(x * _like(input_scale, x)) * _like(alpha * scale, x)
    return jnp.where(x <= 0, negative, x * _like(scale, x))


@activation(aten.elu.default)
def elu(ctx, x, alpha=1, scale=1, input_scale=1):
    return _elu(x, alpha, scale, input_scale)


@activation(aten.celu.default)
def celu(ctx, x, alpha=1.0):
    return _elu(x, alpha, 1, 1 / alpha)


@gradient(aten.elu_backward.default, operands=("grad_output", "self_or_result"))
def elu_backward(ctx, grad, alpha, scale, input_scale, is_result, self_or_result):
    y = self_or_result
    negcoef, input_scale = _like(alpha * scale, y), _like(input_scale, y)
    if is_result:
        negative = grad * input_scale * (y + negcoef)
    else:
        negative = grad * input_scale * negcoef * jnp.exp(y * input_scale)
    return jnp.where(y <= 0, negative, grad * _like(scale, y))


# --- smooth gates --------------------------------------------------------------------------------


@activation(aten.gelu.default)
def gelu(ctx, x, *, approximate="none"):
    if approximate == "tanh":
        inner = _GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return x * 0.5 * (1 + lax.erf(x * _SQRT1_2))


@gradient(aten.gelu_backward.default)
def gelu_backward(ctx, grad, x, *, approximate="none"):
    if approximate == "tanh":
        x_sq = x * x
        tanh_inner = jnp.tanh(_GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x_sq * x))
        left_derivative = 0.5 * (1 + tanh_inner)
        right_derivative = (
            0.5 * x * (1 - tanh_inner * tanh_inner) * _GELU_TANH_BETA * (1 + 3 * _GELU_TANH_KAPPA * x_sq)
        )
        return grad * (left_derivative + right_derivative)
    cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
    pdf = jnp.exp(-0.5 * x * x) * _GELU_PDF
    return grad * (cdf + x * pdf)


@activation(aten.silu.default)
def silu(ctx, x):
    return x / (1 + jnp.exp(-x))


@activation(aten.mish.default)
def mish(ctx, x):
    return x * jnp.tanh(jnp.log1p(jnp.exp(x)))


@gradient(aten.sigmoid_backward.default, operands=("grad_output", "output"))
def sigmoid_backward(ctx, grad, y):
    return grad * (1 - y) * y


@gradient(aten.tanh_backward.default, operands=("grad_output", "output"))
def tanh_backward(ctx, grad, y):
    return grad * (1 - y * y)


@gradient(aten.logit_backward.default)
def logit_backward(ctx, grad, x, eps=None):
    derivative = grad / (x * (1 - x))
    outside_unit = (x < 0) | (x > 1)
    unclamped = jnp.where(
        outside_unit, jnp.full_like(x, jnp.nan), jnp.where((x == 0) | (x == 1), grad * jnp.inf, derivative)
    )
    if eps is None:
        return unclamped
    eps = _like(eps, x)
    clamped = jnp.where((x < eps) | (x > 1 - eps), _zero(x), derivative)
    return jnp.where(eps < 0, unclamped, clamped)


@activation(aten.softplus.default)
def softplus(ctx, x, beta=1, threshold=20):
    scaled = x * _like(beta, x)
    return jnp.where(scaled > threshold, x, jnp.log1p(jnp.exp(scaled)) / _like(beta, x))


@gradient(aten.softplus_backward.default)
def softplus_backward(ctx, grad, x, beta, threshold):
    scaled = x * _like(beta, x)
    z = jnp.exp(scaled)
    return jnp.where(scaled > threshold, grad, grad * z / (z + 1))


@pointwise(aten.log_sigmoid_forward.default, operands=("self",), keep_result_dtype=True)
def log_sigmoid_forward(ctx, x):
    # log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)); the buffer holds exp(-|x|).
    z = jnp.exp(-jnp.abs(x))
    return jnp.minimum(x, _zero(x)) - jnp.log1p(z), z


@gradient(aten.log_sigmoid_backward.default, operands=("grad_output", "self", "buffer"))
def log_sigmoid_backward(ctx, grad, x, buffer):
    z = jnp.exp(-jnp.abs(x))
    negative = x < 0
    max_derivative = jnp.where(negative, jnp.ones_like(x), _zero(x))
    sign = jnp.where(negative, jnp.ones_like(x), -jnp.ones_like(x))
    return (max_derivative - sign * (z / (1 + z))) * grad


@pointwise(aten.glu.default, promotion=DEFAULT, operands=("self",))
def glu(ctx, x, dim=-1):
    a, b = jnp.split(x, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@gradient(aten.glu_backward.default)
def glu_backward(ctx, grad, x, dim):
    a, b = jnp.split(x, 2, axis=dim)
    gate = jax.nn.sigmoid(b)
    return jnp.concatenate([grad * gate, grad * a * gate * (1 - gate)], axis=dim)


# --- hard approximations and shrinkage -----------------------------------------------------------


@activation(aten.hardsigmoid.default)
def hardsigmoid(ctx, x):
    return jnp.minimum(jnp.maximum(x + 3, _zero(x)), _like(6, x)) / 6


@gradient(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(ctx, grad, x):
    return jnp.where((x > -3) & (x < 3), grad / 6, _zero(grad))


@activation(aten.hardswish.default)
def hardswish(ctx, x):
    return x * jnp.minimum(jnp.maximum(x + 3, _zero(x)), _like(6, x)) / 6


@gradient(aten.hardswish_backward.default)
def hardswish_backward(ctx, grad, x):
    return jnp.where(x <= -3, _zero(grad), jnp.where(x < 3, grad * (x / 3 + 0.5), grad))


@activation(aten.softshrink.default)
def softshrink(ctx, x, lambd=0.5):
    lambd = _like(lambd, x)
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, x * 0))


@activation(aten.hardshrink.default)
def hardshrink(ctx, x, lambd=0.5):
    lambd = _like(lambd, x)
    return jnp.where((x >= -lambd) & (x <= lambd), _zero(x), x)


@gradient(
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
    operands=("grad_output", "grad_out", "self"),
)
def shrink_backward(ctx, grad, x, lambd):
    # Both shrinkages pass the gradient outside [-lambd, lambd] and stop it inside.
    lambd = _like(lambd, x)
    return jnp.where((x >= -lambd) & (x <= lambd), _zero(grad), grad)
