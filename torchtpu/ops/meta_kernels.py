"""Meta kernels (shape and dtype rules) that PyTorch lacks for ops lowered on `tpu`.

The executors learn an op's output metadata by running it on meta tensors. A few ATen ops have
no Meta kernel in PyTorch (their CPU kernels allocate outputs themselves); these rules give them
one, so that their lowerings can run. Each rule only allocates outputs, like the ones in
`torch/_meta_registrations.py`.
"""

from __future__ import annotations

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
