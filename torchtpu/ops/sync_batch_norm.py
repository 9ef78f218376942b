"""The per-device statistics ops of `nn.SyncBatchNorm`, as compositions of lowered ops.

`SyncBatchNorm` (what `convert_sync_batchnorm` makes of a DDP model's batch norms) computes each
rank's per-channel mean and inverse standard deviation (`batch_norm_stats`), all-gathers them
with the counts, combines them and updates the running statistics
(`batch_norm_gather_stats_with_counts`), normalizes (`batch_norm_elemt`) and, backward, reduces
and applies the gradient terms (`batch_norm_backward_reduce`, `batch_norm_backward_elemt`).
PyTorch allows it on the PrivateUse1 device, but these five ops have CUDA kernels only: on tpu
they failed ("could not run ... with arguments from the 'CPU' backend"). The formulas are
CUDA's: statistics in float32 for low-precision inputs, the variance biased for normalization
and unbiased for the running variance. Channels are dimension 1.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._ops import OpOverload

aten = torch.ops.aten


def _reduced(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels'."""
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A `[C]` tensor shaped to broadcast over `x`'s channel dimension."""
    return t.view(1, -1, *[1] * (x.dim() - 2))


def _statistics_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def batch_norm_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-channel mean and `1 / sqrt(biased variance + eps)`."""
    x = input.to(_statistics_dtype(input))
    var, mean = torch.var_mean(x, _reduced(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def batch_norm_gather_stats_with_counts(
    input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None, momentum: float, eps: float, counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics of all ranks' inputs from each rank's `[W, C]` means and inverse standard
    deviations and its count; the running statistics updated in place (unbiased variance)."""
    counts = counts.to(mean.dtype).view(-1, 1)
    total = counts.sum()
    global_mean = (counts * mean).sum(0) / total
    rank_var = 1 / (invstd * invstd) - eps
    squares = (counts * (rank_var + (mean - global_mean) ** 2)).sum(0)
    global_invstd = torch.rsqrt(squares / total + eps)
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        unbiased = squares / (total - 1)
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return global_mean, global_invstd


def batch_norm_elemt(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """`(input - mean) * invstd * weight + bias`, per channel."""
    x = input.to(mean.dtype)
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight.to(mean.dtype), x)
    if bias is not None:
        out = out + _per_channel(bias.to(mean.dtype), x)
    return out.to(input.dtype)


def batch_norm_backward_reduce(
    grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
    weight: torch.Tensor | None, input_g: bool, weight_g: bool, bias_g: bool,
) -> tuple[torch.Tensor | None, ...]:
    """Per channel: `sum(dy)` and `sum(dy * (x - mean))` (for the input's gradient, `input_g`), the
    weight's gradient `sum(dy * (x - mean)) * invstd` (`weight_g`) and the bias's `sum(dy)`
    (`bias_g`); None, PyTorch's undefined tensor, for what is not asked for."""
    dims = _reduced(input)
    dy, x = grad_out.to(mean.dtype), input.to(mean.dtype)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(dims)
    parameter_dtype = weight.dtype if weight is not None else input.dtype
    return (
        sum_dy if input_g else None,
        sum_dy_xmu if input_g else None,
        (sum_dy_xmu * invstd).to(parameter_dtype) if weight_g else None,
        sum_dy.to(parameter_dtype) if bias_g else None,
    )


def batch_norm_backward_elemt(
    grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
    weight: torch.Tensor | None, sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor, count: torch.Tensor,
) -> torch.Tensor:
    """The input's gradient from the all-reduced sums over `count`'s total number of values:
    `(dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean))) * invstd * weight`."""
    total = count.to(mean.dtype).sum()
    dy, x = grad_out.to(mean.dtype), input.to(mean.dtype)
    scale = invstd if weight is None else invstd * weight.to(mean.dtype)
    xmu = x - _per_channel(mean, x)
    grad = dy - _per_channel(sum_dy / total, x) - xmu * _per_channel(invstd * invstd * sum_dy_xmu / total, x)
    return (grad * _per_channel(scale, x)).to(input.dtype)


SYNC_BATCH_NORM: dict[OpOverload, Callable] = {
    aten.batch_norm_stats.default: batch_norm_stats,
    aten.batch_norm_gather_stats_with_counts.default: batch_norm_gather_stats_with_counts,
    aten.batch_norm_elemt.default: batch_norm_elemt,
    aten.batch_norm_backward_reduce.default: batch_norm_backward_reduce,
    aten.batch_norm_backward_elemt.default: batch_norm_backward_elemt,
}
"""SyncBatchNorm's ops, as the compositions eager mode runs in their place (`decomps.get`)."""
