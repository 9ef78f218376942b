"""Pointwise lowerings: arithmetic, comparisons, fills and copies."""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.promotion import ALWAYS_BOOL, DEFAULT, INT_TO_FLOAT, pointwise

aten = torch.ops.aten


@pointwise(aten.add.Tensor, aten.add.Scalar)
def add(ctx, x, y, alpha=1):
    return x + y * alpha if not _is_one(alpha) else x + y


@pointwise(aten.sub.Tensor, aten.sub.Scalar)
def sub(ctx, x, y, alpha=1):
    return x - y * alpha if not _is_one(alpha) else x - y


@pointwise(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx, x, y):
    return x * y


@pointwise(aten.div.Tensor, aten.div.Scalar, promotion=INT_TO_FLOAT)
def div(ctx, x, y):
    return x / y


@pointwise(aten.neg.default, operands=("self",))
def neg(ctx, x):
    return -x


@pointwise(aten.exp.default, operands=("self",), promotion=INT_TO_FLOAT)
def exp(ctx, x):
    return jnp.exp(x)


@pointwise(aten.eq.Tensor, aten.eq.Scalar, promotion=ALWAYS_BOOL)
def eq(ctx, x, y):
    return x == y


@registry.register(aten.fill.Scalar, dynamic_scalars=True)
def fill(ctx, x, value):
    return jnp.full(x.shape, value, ctx.out_dtype())


@registry.register(aten.zero.default)
def zero(ctx, x):
    return jnp.zeros(x.shape, ctx.out_dtype())


@registry.register(aten.copy.default)
def copy(ctx, x, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(ctx.out_dtype()), x.shape)


def _is_one(value) -> bool:
    return isinstance(value, (int, float)) and value == 1
