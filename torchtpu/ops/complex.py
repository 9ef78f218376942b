"""Complex tensors: which lowerings accept them, and the ops only complex numbers need.

jnp takes complex arrays almost everywhere, but not always with PyTorch's meaning (it orders
complex numbers lexicographically, for one, where PyTorch refuses to). So a lowering sees a
complex tensor only if it is declared here (or by its own module, as `fft` does) and its complex
results are checked against CPU (tests/torchtpu/test_fft.py); every other lowering raises
`registry.ComplexNotSupported` naming the op and dtype (`registry.check_complex`).

The conjugate of a tensor is lazy in PyTorch (a math bit, resolved by `opcall.read_tensor`);
`_conj_physical` is the op that materialises one. `torch.complex` and `torch.polar` build complex
tensors from real parts (lowered here, so compiled graphs hold them too).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu.ops import registry

aten = torch.ops.aten


@registry.register(aten._conj_physical.default, aten.conj_physical.default, aten._conj.default)
def conj_physical(ctx, x):
    """The complex conjugate (the identity on real tensors). `_conj` is the lazy conjugate's
    view: eager mode sets its math bit, never this; compiled graphs (a complex backward's) hold
    it as a value."""
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


@registry.register(aten._neg_view.default)
def neg_view(ctx, x):
    """The lazy negation's view, as a value (compiled graphs; eager mode sets the math bit)."""
    return -x


@registry.register(aten.complex.default)
def complex_(ctx, real, imag):
    """`torch.complex`: a complex tensor of the given parts (float32 -> complex64, float64 ->
    complex128)."""
    return lax.complex(real, imag).astype(ctx.out_dtype())


@registry.register(aten.polar.default)
def polar(ctx, radius, angle):
    """`torch.polar(abs, angle)`: `abs * (cos(angle) + i sin(angle))`, each part computed as
    ATen's kernel does, in the parts' dtype."""
    return lax.complex(radius * jnp.cos(angle), radius * jnp.sin(angle)).astype(ctx.out_dtype())


def _overloads(*packets) -> list:
    return [getattr(packet, name) for packet in packets for name in packet.overloads()]


# Lowerings whose complex results are PyTorch's: arithmetic and the analytic functions jnp
# defines on the complex plane, equality, copies and data movement, sums and products, matmuls,
# and the views.
registry.allow_complex(*[op for op in _overloads(
    aten.add, aten.sub, aten.rsub, aten.mul, aten.neg, aten.abs, aten.reciprocal, aten.square,
    aten.exp, aten.expm1, aten.log, aten.log1p, aten.log2, aten.log10, aten.sqrt, aten.rsqrt,
    aten.sin, aten.cos, aten.tan, aten.sinh, aten.cosh, aten.tanh, aten.sigmoid,
    aten.asin, aten.acos, aten.atan, aten.asinh, aten.acosh, aten.atanh,
    aten.pow, aten.angle, aten.sgn, aten.complex, aten.polar, aten._conj_physical, aten.conj_physical,
    aten._conj, aten._neg_view,
    aten.eq, aten.ne, aten.isnan, aten.where, aten.masked_fill,
    aten.clone, aten.copy, aten.fill, aten.zero, aten.full, aten.full_like, aten.zeros_like,
    aten.ones_like, aten.scalar_tensor, aten._to_copy, aten.cat, aten.stack, aten.flip, aten.roll,
    aten.index_select, aten.gather, aten.constant_pad_nd,
    aten.sum, aten.mean, aten.prod, aten.cumsum,
    aten.mm, aten.bmm, aten.addmm, aten.baddbmm,
    aten.view, aten.view_copy, aten._reshape_alias, aten._reshape_alias_copy, aten._unsafe_view,
    aten.squeeze, aten.squeeze_copy, aten.unsqueeze, aten.unsqueeze_copy, aten.alias, aten.alias_copy,
    aten.detach, aten.detach_copy, aten.lift_fresh_copy, aten.permute, aten.permute_copy,
    aten.transpose, aten.transpose_copy, aten.t, aten.t_copy, aten.expand, aten.expand_copy,
    aten.slice, aten.slice_copy, aten.select, aten.select_copy, aten.diagonal, aten.diagonal_copy,
    aten.unfold, aten.unfold_copy, aten.as_strided, aten.split, aten.split_copy,
    aten.split_with_sizes, aten.split_with_sizes_copy, aten.unbind, aten.unbind_copy,
    aten.view_as_real, aten.view_as_real_copy, aten.view_as_complex, aten.view_as_complex_copy,
    aten.select_backward, aten.slice_backward,
    aten.randn, aten.normal_functional,
)] + [aten.div.Tensor, aten.div.Scalar])
