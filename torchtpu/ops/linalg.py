"""Matrix products (mm, bmm, addmm, ... with TPU precision modes) and linear algebra.

Every floating-point product goes through `torchtpu.precision.dot_general`, so the matmul
precision mode (1, 3 or 6 bf16 passes for float32) holds for all of them; bf16/f16 operands
accumulate in float32 and round once, as PyTorch's CPU kernels do. The `add*` family follows
ATen: `beta * self + alpha * product`, and `beta == 0` ignores `self` (NaN in it does not
propagate).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu import precision
from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten

# dimension_numbers of lax.dot_general: ((lhs contracting, rhs contracting), (lhs batch, rhs batch))
_MM = (((1,), (0,)), ((), ()))
_BMM = (((2,), (1,)), ((0,), (0,)))
_MV = (((1,), (0,)), ((), ()))
_DOT = (((0,), (0,)), ((), ()))


def product(ctx, a, b, dimension_numbers):
    """`a`·`b` in the call's precision mode, in opmath dtype (float32 for bf16/f16 results)."""
    return precision.dot_general(
        a, b, dimension_numbers, ctx.precision, ctx.platform, opmath(ctx.out_dtype())
    )


def _accumulate(ctx, self, prod, beta, alpha):
    """`beta * self + alpha * prod`, with `self` ignored when `beta == 0`, in `prod`'s dtype."""
    out = prod if alpha == 1 else prod * jnp.asarray(alpha, prod.dtype)
    if beta != 0:
        self = self.astype(prod.dtype)
        out = out + (self if beta == 1 else self * jnp.asarray(beta, prod.dtype))
    return out.astype(ctx.out_dtype())


@registry.register(aten.mm.default)
def mm(ctx, a, b):
    return product(ctx, a, b, _MM)


@registry.register(aten.bmm.default)
def bmm(ctx, a, b):
    return product(ctx, a, b, _BMM)


@registry.register(aten.mv.default)
def mv(ctx, a, v):
    return product(ctx, a, v, _MV)


@registry.register(aten.dot.default, aten.vdot.default)
def dot(ctx, a, b):
    # vdot conjugates its first operand: the same as dot for the real dtypes the device has.
    return product(ctx, a, b, _DOT)


@registry.register(aten.addmm.default)
def addmm(ctx, self, a, b, *, beta=1, alpha=1):
    return _accumulate(ctx, self, product(ctx, a, b, _MM), beta, alpha)


@registry.register(aten.addmv.default)
def addmv(ctx, self, a, v, *, beta=1, alpha=1):
    return _accumulate(ctx, self, product(ctx, a, v, _MV), beta, alpha)


@registry.register(aten.baddbmm.default)
def baddbmm(ctx, self, a, b, *, beta=1, alpha=1):
    return _accumulate(ctx, self, product(ctx, a, b, _BMM), beta, alpha)


@registry.register(aten.addbmm.default)
def addbmm(ctx, self, a, b, *, beta=1, alpha=1):
    # Contract the batch dimension together with k: sum_b a[b] @ b[b] is one matmul.
    return _accumulate(ctx, self, product(ctx, a, b, (((0, 2), (0, 1)), ((), ()))), beta, alpha)


@registry.register(aten._int_mm.default)
def int_mm(ctx, a, b):
    return precision.dot_general(a, b, _MM, ctx.precision, ctx.platform, np.int32)
