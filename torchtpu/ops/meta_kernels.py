"""Meta kernels (shape and dtype rules) that PyTorch lacks for ops lowered on `tpu`.

The executors learn an op's output metadata by running it on meta tensors. A few ATen ops have
no Meta kernel in PyTorch (their CPU kernels allocate outputs themselves); these rules give them
one, so that their lowerings can run. Each rule only allocates outputs, like the ones in
`torch/_meta_registrations.py`.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

_lib = torch.library.Library("aten", "IMPL")


def _meta(op: torch._ops.OpOverload):
    def decorator(fn):
        _lib.impl(op, fn, "Meta")
        return fn

    return decorator


@_meta(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=1):
    return torch.empty_like(x)


@_meta(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    return torch.empty_like(x)


@_meta(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return torch.empty_like(x)


@_meta(aten.geqrf.default)
def geqrf(x):
    if x.dim() < 2:
        raise RuntimeError(f"geqrf: The input tensor A must have at least 2 dimensions, got {x.dim()}")
    m, n = x.shape[-2:]
    return (
        torch.empty_like(x).mT.contiguous().mT,  # column-major, as LAPACK returns it
        x.new_empty((*x.shape[:-2], min(m, n))),
    )


@_meta(aten._ctc_loss_backward.default)
def ctc_loss_backward(grad, log_probs, *args, **kwargs):
    return torch.empty_like(log_probs)


def _check_histogram_input(x, weight, edges_dtype) -> None:
    """The argument checks of ATen's CPU histogram (`histogramdd_check_inputs`)."""
    if x.dtype not in (torch.float32, torch.float64):
        raise NotImplementedError(f'"histogramdd" not implemented for {x.dtype}')
    if edges_dtype != x.dtype:
        raise RuntimeError("torch.histogramdd: input tensor and bins tensors should have the same dtype")
    if weight is not None:
        if weight.shape != x.shape:
            raise RuntimeError(
                f"torch.histogramdd: if weight tensor is provided it should have the same shape as the "
                f"input tensor excluding its innermost dimension, but got {tuple(weight.shape)} and {tuple(x.shape)}"
            )
        if weight.dtype != x.dtype:
            raise RuntimeError("torch.histogramdd: if weight tensor is provided, input tensor and weight tensor should have the same dtype")


@_meta(aten.histogram.bin_ct)
def histogram(x, bins=100, *, range=None, weight=None, density=False):
    _check_histogram_input(x, weight, x.dtype)
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    if range is not None:
        if len(range) != 2:
            raise RuntimeError(f"torch.histogramdd: for a 1-dimensional histogram range should have 2 elements, but got {len(range)}")
        low, high = range
        if not (math.isfinite(low) and math.isfinite(high)):
            raise RuntimeError(f"torch.histogramdd: dimension 0's range [{low}, {high}] is not finite")
        if low > high:
            raise RuntimeError(f"torch.histogramdd: min should not exceed max, but got min {low} max {high} for dimension 0")
    return x.new_empty(bins), x.new_empty(bins + 1)


@_meta(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, *, weight=None, density=False):
    _check_histogram_input(x, weight, bins.dtype)
    if bins.dim() != 1:
        raise RuntimeError(f"torch.histogramdd: bins tensor should have one dimension, but got {bins.dim()} dimensions in the bins tensor for dimension 0")
    if bins.numel() == 0:
        raise RuntimeError("torch.histogramdd: bins tensor should have at least 1 element, but got 0 elements for dimension 0")
    return x.new_empty(bins.numel() - 1), torch.empty_like(bins)


def _check_histogramdd_input(x, edges_dtypes: list, weight) -> None:
    """The argument checks of ATen's CPU histogramdd (`histogramdd_check_inputs`), for an input
    of points (..., N) and N sequences of bin edges of `edges_dtypes`."""
    if x.dim() < 2:
        raise RuntimeError(f"torch.histogramdd: input tensor should have at least 2 dimensions, but got {x.dim()}")
    if x.dtype not in (torch.float32, torch.float64):
        raise NotImplementedError(f'"histogramdd" not implemented for {x.dtype}')
    n = x.shape[-1]
    if len(edges_dtypes) != n:
        raise RuntimeError(f"torch.histogramdd: expected {n} sequences of bin edges for a {n}-dimensional "
                           f"histogram but got {len(edges_dtypes)}")
    for dim, dtype in enumerate(edges_dtypes):
        if dtype != x.dtype:
            raise RuntimeError(f"torch.histogramdd: input tensor and bins tensors should have the same dtype, but got "
                               f"input with dtype {x.dtype} and bins for dimension {dim} with dtype {dtype}")
    if weight is not None:
        if weight.dtype != x.dtype:
            raise RuntimeError("torch.histogramdd: if weight tensor is provided, input tensor and weight tensor "
                               f"should have the same dtype, but got input({x.dtype}), and weight({weight.dtype})")
        if tuple(weight.shape or (1,)) != tuple(x.shape[:-1]):
            raise RuntimeError("torch.histogramdd: if weight tensor is provided it should have the same shape as the "
                               "input tensor excluding its innermost dimension, but got input with shape "
                               f"{tuple(x.shape)} and weight with shape {tuple(weight.shape)}")


def _check_bin_counts(x, bins, bounds) -> None:
    """histogramdd's checks of bin counts and a given range (ATen's select_outer_bin_edges)."""
    _check_histogramdd_input(x, [x.dtype] * len(bins), None)
    n = x.shape[-1]
    for dim, count in enumerate(bins):
        if count <= 0:
            raise RuntimeError(f"torch.histogramdd(): bins must be > 0, but got {count} for dimension {dim}")
    if bounds is not None:
        if len(bounds) != 2 * n:
            raise RuntimeError(f"torch.histogramdd: for a {n}-dimensional histogram range should have {2 * n} "
                               f"elements, but got {len(bounds)}")
        for dim in range(n):
            low, high = bounds[2 * dim], bounds[2 * dim + 1]
            if not (math.isfinite(low) and math.isfinite(high)):
                raise RuntimeError(f"torch.histogramdd: dimension {dim}'s range [{low}, {high}] is not finite")
            if low > high:
                raise RuntimeError(f"torch.histogramdd: min should not exceed max, but got min {low} max {high} "
                                   f"for dimension {dim}")


@_meta(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    _check_bin_counts(x, bins, range)
    _check_histogramdd_input(x, [x.dtype] * len(bins), weight)
    return [x.new_empty(count + 1) for count in bins]


@_meta(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    _check_bin_counts(x, bins, range)
    _check_histogramdd_input(x, [x.dtype] * len(bins), weight)
    return x.new_empty(tuple(bins))


@_meta(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    _check_histogramdd_input(x, [b.dtype for b in bins], weight)
    for dim, edges in enumerate(bins):
        if edges.dim() != 1:
            raise RuntimeError(f"torch.histogramdd: bins tensor should have one dimension, but got {edges.dim()} "
                               f"dimensions in the bin tensor for dimension {dim}")
        if edges.numel() == 0:
            raise RuntimeError(f"torch.histogramdd: bins tensor should have at least 1 element, but got 0 elements "
                               f"in the bin tensor for dimension {dim}")
    return x.new_empty(tuple(edges.numel() - 1 for edges in bins))


def _optimizer_step(*args, **kwargs) -> None:
    """An in-place optimizer step (`_fused_sgd_`, ...): it returns nothing and changes no
    tensor's metadata."""


for _op in (aten._fused_adam_.tensor_lr, aten._fused_adamw_.tensor_lr, aten._fused_sgd_.default,
            aten._fused_sgd_.tensor_lr, aten._fused_adagrad_.default, aten._fused_adagrad_.tensor_lr):
    _meta(_op)(_optimizer_step)


@_meta(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    return torch.empty_like(hx), hx.new_empty((hx.shape[0], 5 * hx.shape[1]))


@_meta(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    batch, hidden = grad_hy.shape
    gates = grad_hy.new_empty((batch, 3 * hidden))
    biases = (grad_hy.new_empty(3 * hidden), grad_hy.new_empty(3 * hidden)) if has_bias else (None, None)
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), *biases
