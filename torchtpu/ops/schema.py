"""What the executors need to know about an ATen overload, read once from its schema.

For each argument: whether it carries tensors, a Scalar (a number whose value may change every
step, such as a learning rate), or a static value (dims, sizes, flags, dtypes) that shapes the
compiled program. For the overload: which arguments it writes (in-place and `out=` variants),
and the functional overload whose lowering computes its values.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
from torch._ops import OpOverload


class ArgKind(enum.Enum):
    TENSOR = "tensor"  # Tensor or Tensor?
    TENSOR_LIST = "tensor_list"  # Tensor[] or Tensor?[]
    SCALAR = "scalar"  # Scalar / Scalar? / float / float?
    SCALAR_LIST = "scalar_list"  # Scalar[] / float[]
    STATIC = "static"


@dataclass(frozen=True)
class Arg:
    name: str
    kind: ArgKind
    kwarg_only: bool
    has_default: bool
    default: object
    writes: bool


@dataclass(frozen=True)
class Signature:
    op: OpOverload
    args: tuple[Arg, ...]
    num_outputs: int

    @functools.cached_property
    def index(self) -> dict[str, int]:
        return {a.name: i for i, a in enumerate(self.args)}

    @functools.cached_property
    def written(self) -> tuple[int, ...]:
        """Indices of the arguments this overload mutates."""
        return tuple(i for i, a in enumerate(self.args) if a.writes)

    @property
    def is_out(self) -> bool:
        return any(a.writes and a.kwarg_only for a in self.args)

    @property
    def is_inplace(self) -> bool:
        return bool(self.written) and not self.is_out

    def normalize(self, args: tuple, kwargs: dict) -> list:
        """All argument values in schema order, defaults filled in."""
        values = list(args)
        for arg in self.args[len(args):]:
            if arg.name in kwargs:
                values.append(kwargs[arg.name])
            elif arg.has_default:
                values.append(arg.default)
            else:
                raise TypeError(f"{self.op}: missing argument {arg.name!r}")
        return values

    def split(self, values: list) -> tuple[list, dict]:
        """Schema-ordered values back to (positional, keyword-only) form."""
        pos, kw = [], {}
        for arg, value in zip(self.args, values):
            if arg.kwarg_only:
                kw[arg.name] = value
            else:
                pos.append(value)
        return pos, kw


def _kind(jit_type) -> ArgKind:
    kind = jit_type.kind()
    if kind == "OptionalType":
        return _kind(jit_type.getElementType())
    if kind == "TensorType":
        return ArgKind.TENSOR
    if kind in ("NumberType", "FloatType"):
        return ArgKind.SCALAR
    if kind == "ListType":
        element = _kind(jit_type.getElementType())
        if element is ArgKind.TENSOR:
            return ArgKind.TENSOR_LIST
        if element is ArgKind.SCALAR:
            return ArgKind.SCALAR_LIST
    return ArgKind.STATIC


def _default(arg) -> object:
    if not arg.has_default_value():
        return None
    value = arg.default_value
    # The schema stores dtype defaults as ints (ScalarType enums); None stays None.
    return value


@functools.lru_cache(maxsize=None)
def signature(op: OpOverload) -> Signature:
    schema = op._schema
    args = tuple(
        Arg(
            name=a.name,
            kind=_kind(a.type),
            kwarg_only=a.kwarg_only,
            has_default=a.has_default_value(),
            default=_default(a),
            writes=bool(a.alias_info and a.alias_info.is_write),
        )
        for a in schema.arguments
    )
    return Signature(op, args, len(schema.returns))


@functools.lru_cache(maxsize=None)
def functional_variant(op: OpOverload) -> OpOverload | None:
    """The functional overload computing the values an in-place or `out=` overload writes.

    `aten.add_.Tensor` -> `aten.add.Tensor`; `aten.add.out` -> `aten.add.Tensor` (the overload
    of the same name whose arguments are the non-out arguments). None if there is none.
    """
    sig = signature(op)
    if not sig.written:
        return op
    namespace = getattr(torch.ops, op.namespace)
    name = op._schema.name.split("::")[1]
    if sig.is_inplace:
        packet = getattr(namespace, name.rstrip("_"), None) if name.endswith("_") else None
        if packet is None:
            return None
        candidate = getattr(packet, op._overloadname, None)
        return candidate if candidate is not None and not signature(candidate).written else None
    inputs = [(a.name, str(t.type)) for a, t in zip(sig.args, op._schema.arguments) if not a.writes]
    packet = getattr(namespace, name, None)
    if packet is None:
        return None
    for overload_name in packet.overloads():
        candidate = getattr(packet, overload_name)
        if signature(candidate).written:
            continue
        if [(a.name, str(a.type)) for a in candidate._schema.arguments] == inputs:
            return candidate
    return None
