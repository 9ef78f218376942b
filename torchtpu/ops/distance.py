"""Pairwise p-norm distances (`cdist`, `pdist`) and their backward ops.

Distances compute in opmath and reuse `reduction.vector_norm`. Like PyTorch's kernels,
`_cdist_forward` takes the matmul route `|a|^2 + |b|^2 - 2 a.b` for p = 2 when `compute_mode`
asks for it (1, or 0 with more than 25 rows), through the precision-aware matmul; otherwise it
reduces the differences directly. Gradients define d|x|_p/dx as 0 where the distance is 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu import precision
from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath, vector_norm

aten = torch.ops.aten

_MM_ROWS = 25  # above this many rows compute_mode 0 takes the matmul route, as in ATen


def _uses_matmul(p: float, compute_mode: int | None, rows1: int, rows2: int) -> bool:
    mode = 0 if compute_mode is None else compute_mode
    return p == 2 and (mode == 1 or (mode == 0 and (rows1 > _MM_ROWS or rows2 > _MM_ROWS)))


def _pnorm_grad(diff, dist, p: float):
    """d dist / d diff for dist = |diff|_p over the last axis (`dist` broadcast against diff)."""
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return jnp.sign(diff)
    zero = jnp.zeros((), diff.dtype)
    if p == math.inf:
        return jnp.where(jnp.abs(diff) == dist, jnp.sign(diff), zero)
    safe = jnp.where(dist == 0, jnp.ones((), dist.dtype), dist)
    if p == 2:
        return jnp.where(dist == 0, zero, diff / safe)
    grad = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
    degenerate = (dist == 0) | ((diff == 0) & (p < 1))
    return jnp.where(degenerate, zero, grad)


def _differences(x1, x2):
    """(..., P, 1, D) - (..., 1, R, D)."""
    return x1[..., :, None, :] - x2[..., None, :, :]


@registry.register(aten._cdist_forward.default)
def cdist_forward(ctx, x1, x2, p: float, compute_mode):
    compute = opmath(ctx.out_dtype())
    x1, x2 = x1.astype(compute), x2.astype(compute)
    if _uses_matmul(p, compute_mode, x1.shape[-2], x2.shape[-2]):
        batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
        a = jnp.broadcast_to(x1, batch + x1.shape[-2:])
        b = jnp.broadcast_to(x2, batch + x2.shape[-2:])
        nb = len(batch)
        dims = (((nb + 1,), (nb + 1,)), (tuple(range(nb)), tuple(range(nb))))
        cross = precision.dot_general(a, b, dims, ctx.precision, ctx.platform, compute)
        squares = (jnp.sum(jnp.square(a), -1)[..., :, None] + jnp.sum(jnp.square(b), -1)[..., None, :])
        return jnp.sqrt(jnp.maximum(squares - 2 * cross, 0))
    return vector_norm(_differences(x1, x2), float(p), (-1,), False)


@registry.register(aten._cdist_backward.default)
def cdist_backward(ctx, grad, x1, x2, p: float, dist):
    compute = opmath(ctx.out_dtype())
    grad, x1, x2, dist = (t.astype(compute) for t in (grad, x1, x2, dist))
    diff = _differences(x1, x2)
    per_pair = grad[..., None] * _pnorm_grad(diff, dist[..., None], float(p))
    # The gradient of the broadcast x1 (autograd sums it back to x1's own shape).
    return jnp.broadcast_to(jnp.sum(per_pair, -2), ctx.out_shape())


def _pairs(n: int):
    """Row indices (i, j), i < j, in the order pdist lists them."""
    i, j = np.triu_indices(n, 1)
    return i.astype(np.int32), j.astype(np.int32)


@registry.register(aten._pdist_forward.default)
def pdist_forward(ctx, x, p: float = 2):
    x = x.astype(opmath(ctx.out_dtype()))
    i, j = _pairs(x.shape[0])
    return vector_norm(x[i] - x[j], float(p), (-1,), False)


@registry.register(aten._pdist_backward.default)
def pdist_backward(ctx, grad, x, p: float, dist):
    compute = opmath(ctx.out_dtype())
    grad, x, dist = (t.astype(compute) for t in (grad, x, dist))
    n = x.shape[0]
    i, j = _pairs(n)
    per_pair = grad[:, None] * _pnorm_grad(x[i] - x[j], dist[:, None], float(p))
    return jax.ops.segment_sum(per_pair, i, n) - jax.ops.segment_sum(per_pair, j, n)
