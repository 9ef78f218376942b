"""The `_foreach_*` ops that torch.optim's foreach implementations and `clip_grad_norm_` call.

A whole list runs as ONE program: an optimizer step over many parameters is one XLA program per
foreach call, not one per parameter. Position `i` of a call is computed by the lowering of its
element op -- `_foreach_add.List` at `i` is `add.Tensor(self[i], other[i], alpha=alpha)` -- with
that op's own type promotion, so no op's math is written twice. The in-place forms
(`_foreach_add_`) write these results into the list's tensors, as for any in-place op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload

from torchtpu.ops import registry
from torchtpu.ops.schema import Arg, ArgKind, signature

aten = torch.ops.aten


def _at(arg: Arg, value: Any, index: int) -> Any:
    """The value of foreach argument `arg` at list position `index`: lists (of tensors or
    scalars) and the 1-D `scalars` tensor are indexed, everything else is shared."""
    if value is None:
        return None
    if arg.kind in (ArgKind.TENSOR_LIST, ArgKind.SCALAR_LIST) or arg.name == "scalars":
        return value[index]
    return value


def _register(op: OpOverload, element: OpOverload, names: tuple[str, ...], dynamic_scalars: bool = True) -> None:
    """Lower `op` as `element` applied at each list position; `names` are the element op's
    argument names for `op`'s arguments, in order. Its Scalars are traced inputs unless
    `dynamic_scalars` is False (see `registry.Lowering`)."""
    sig, element_sig = signature(op), signature(element)
    length_of = next(i for i, arg in enumerate(sig.args) if arg.kind is ArgKind.TENSOR_LIST)

    def lowering(ctx, *args, **kwargs):
        values = sig.normalize(args, kwargs)
        element_lowering = registry.get(element)
        if element_lowering is None:
            raise NotImplementedError(f"{op} runs through {element}, which has no lowering")
        outputs = []
        for index in range(len(values[length_of])):
            at = {n: _at(a, v, index) for n, a, v in zip(names, sig.args, values)}
            meta_at = {n: _at(a, m, index) for n, a, m in zip(names, sig.args, ctx.meta_args)}
            element_ctx = registry.LoweringContext(
                element, element_sig.normalize((), meta_at), ctx.out(index), ctx.precision, ctx.platform
            )
            pos, kw = element_sig.split(element_sig.normalize((), at))
            outputs.append(element_lowering.fn(element_ctx, *pos, **kw))
        return tuple(outputs)

    lowering.__name__ = lowering.__qualname__ = f"foreach_{element.__name__}"
    registry.register(op, dynamic_scalars=dynamic_scalars)(lowering)


_UNARY = (
    "abs", "acos", "asin", "atan", "ceil", "clone", "cos", "cosh", "erf", "erfc", "exp", "expm1",
    "floor", "frac", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
    "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "zero",
)  # fmt: skip


def _binary(element, scalar_element=None, alpha: bool = False) -> dict:
    """The overloads of a binary foreach op: Scalar/ScalarList use `scalar_element`, List/Tensor
    use `element` (with `alpha` where the element op takes one)."""
    tensor_names = ("self", signature(element).args[1].name) + (("alpha",) if alpha else ())
    scalar_element = scalar_element or element
    scalar_names = ("self", signature(scalar_element).args[1].name)
    return {
        "Scalar": (scalar_element, scalar_names),
        "ScalarList": (scalar_element, scalar_names),
        "List": (element, tensor_names),
        "Tensor": (element, tensor_names),
    }


def _pointwise_with_value(element) -> dict:
    names = ("self", "tensor1", "tensor2", "value")
    return {"Scalar": (element, names), "ScalarList": (element, names), "Tensor": (element, names)}


_OVERLOADS: dict[str, dict] = {
    **{name: {"default": (getattr(aten, name).default, ("self",))} for name in _UNARY},
    "add": _binary(aten.add.Tensor, aten.add.Scalar, alpha=True),
    "sub": _binary(aten.sub.Tensor, aten.sub.Scalar, alpha=True),
    "mul": _binary(aten.mul.Tensor, aten.mul.Scalar),
    "div": _binary(aten.div.Tensor, aten.div.Scalar),
    # PyTorch's foreach maximum/minimum with scalars are clamp_min/clamp_max.
    "maximum": _binary(aten.maximum.default, aten.clamp_min.default),
    "minimum": _binary(aten.minimum.default, aten.clamp_max.default),
    "clamp_min": _binary(aten.clamp_min.Tensor, aten.clamp_min.default),
    "clamp_max": _binary(aten.clamp_max.Tensor, aten.clamp_max.default),
    "addcmul": _pointwise_with_value(aten.addcmul.default),
    "addcdiv": _pointwise_with_value(aten.addcdiv.default),
    "lerp": {
        "List": (aten.lerp.Tensor, ("self", "end", "weight")),
        "Scalar": (aten.lerp.Scalar, ("self", "end", "weight")),
        "ScalarList": (aten.lerp.Scalar, ("self", "end", "weight")),
    },
    "pow": {
        "List": (aten.pow.Tensor_Tensor, ("self", "exponent")),
        "Scalar": (aten.pow.Tensor_Scalar, ("self", "exponent")),
        "ScalarList": (aten.pow.Tensor_Scalar, ("self", "exponent")),
        "ScalarAndTensor": (aten.pow.Scalar, ("self", "exponent")),
    },
    "copy": {"default": (aten.copy.default, ("self", "src", "non_blocking"))},
    # Reductions and products of each tensor: `clip_grad_norm_`'s norms and the largest values.
    "norm": {"Scalar": (aten.linalg_vector_norm.default, ("self", "ord", "dtype"))},
    "max": {"default": (aten.max.default, ("self",))},
    "mm": {"default": (aten.mm.default, ("self", "mat2"))},
}

# The norm's order picks its formula (and `linalg_vector_norm` takes it as a constant): a new
# order compiles anew, as it does for the element op.
_STATIC_SCALARS = frozenset({"norm"})

for _name, _overloads in _OVERLOADS.items():
    _packet = getattr(aten, f"_foreach_{_name}")
    for _overload, (_element, _names) in _overloads.items():
        if _overload in _packet.overloads():
            _register(getattr(_packet, _overload), _element, _names, dynamic_scalars=_name not in _STATIC_SCALARS)
