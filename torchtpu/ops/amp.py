"""The gradient scaler's ops: what `torch.amp.GradScaler("tpu")` calls every step.

`_amp_foreach_non_finite_check_and_unscale` unscales a list of gradients and notes whether any of
them holds an inf or NaN; `_amp_update_scale` then grows or backs off the scale. Both run on the
device, as on CUDA, so a training step with a scaler never waits for the host. The arithmetic is
PyTorch's CPU kernels' (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp): reduced-precision
gradients are unscaled in float32, float64 ones in float64; the new scale is the float32 scale
times the factor in float64, rounded once, and a growth that would overflow float32 keeps the
old scale. The checks those kernels make beyond their meta kernels are the `validate` functions.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchtpu import dtypes
from torchtpu.ops import registry

aten = torch.ops.aten


def _check_one_element_float(name: str, t: torch.Tensor) -> None:
    if t.numel() != 1:
        raise RuntimeError(f"{name} must be a 1-element tensor.")
    if t.dtype != torch.float32:
        raise RuntimeError(f"{name} must be a float tensor.")


def _check_unscale(grads, found_inf, inv_scale) -> None:
    """The CPU kernel's checks (an empty list is not checked: the kernel returns at once)."""
    if not grads:
        return
    _check_one_element_float("inv_scale", inv_scale)
    _check_one_element_float("found_inf", found_inf)
    for grad in grads:
        if not grad.is_floating_point():
            raise NotImplementedError(f'"_amp_foreach_non_finite_check_and_unscale_cpu" not implemented for '
                                      f"'{dtypes.aten_name(grad.dtype)}'")


@registry.register(aten._amp_foreach_non_finite_check_and_unscale.default, validate=_check_unscale)
def non_finite_check_and_unscale(ctx, grads, found_inf, inv_scale):
    if not grads:
        return (), found_inf
    unscaled, non_finite = [], []
    for grad in grads:
        opmath = jnp.float64 if grad.dtype == jnp.float64 else jnp.float32
        value = grad.astype(opmath)
        non_finite.append(jnp.any(~jnp.isfinite(value)))
        unscaled.append((value * inv_scale.reshape(()).astype(opmath)).astype(grad.dtype))
    # Set to 1 when a gradient is not finite; otherwise left as it was (the caller zeroes it).
    found = jnp.where(jnp.any(jnp.stack(non_finite)), jnp.ones_like(found_inf), found_inf)
    return tuple(unscaled), found


def _check_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval) -> None:
    if growth_tracker.numel() != 1:
        raise RuntimeError("growth_tracker must be a 1-element tensor.")
    if scale.numel() != 1:
        raise RuntimeError("current_scale must be a 1-element tensor.")
    if found_inf.numel() != 1:
        raise RuntimeError("found_inf must be a 1-element tensor.")
    if growth_tracker.dtype != torch.int32:
        raise RuntimeError("growth_tracker must be an int tensor.")
    if scale.dtype != torch.float32:
        raise RuntimeError("current_scale must be a float tensor.")
    if found_inf.dtype != torch.float32:
        raise RuntimeError("found_inf must be a float tensor.")


@registry.register(aten._amp_update_scale.default, dynamic_scalars=True, validate=_check_update_scale)
def update_scale(ctx, scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Back off after a step with infs or NaNs (and restart the count of good steps); grow after
    `growth_interval` good steps in a row, unless the grown scale overflows."""
    backed_off = (scale.astype(jnp.float64) * backoff_factor).astype(jnp.float32)
    grown = (scale.astype(jnp.float64) * growth_factor).astype(jnp.float32)
    successful = growth_tracker + 1
    grows = successful == growth_interval
    skipped = found_inf != 0
    new_scale = jnp.where(skipped, backed_off, jnp.where(grows & jnp.isfinite(grown), grown, scale))
    new_tracker = jnp.where(skipped | grows, jnp.zeros_like(growth_tracker), successful)
    return new_scale, new_tracker
