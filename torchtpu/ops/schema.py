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
from typing import Sequence, TypeVar

import torch
from torch._ops import OpOverload

T = TypeVar("T")


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


def _argument_key(arg) -> tuple[str, str]:
    """An argument's name and type, without alias annotations or default."""
    return arg.name, str(arg.type)


def _functional_packets(name: str, inplace: bool) -> tuple[str, ...]:
    """Names of the op packets that may hold the functional form of overloads of `name`."""
    if not inplace:
        return (name,)
    base = name[:-1]
    return (base, base + "_functional")


@functools.lru_cache(maxsize=None)
def _functional_form(op: OpOverload) -> tuple[OpOverload, tuple[int, ...]] | None:
    sig = signature(op)
    if not sig.written:
        return op, tuple(range(len(sig.args)))
    name = op._schema.name.split("::")[1]
    if sig.is_inplace and not name.endswith("_"):
        return None
    namespace = getattr(torch.ops, op.namespace)
    # The functional form takes the same arguments (names and types; defaults may differ) less
    # the `out=` ones, possibly in another order: `polygamma_(self, n)` is `polygamma(n, self)`.
    inputs = {
        _argument_key(a): i
        for i, (a, info) in enumerate(zip(op._schema.arguments, sig.args))
        if not (sig.is_out and info.writes)
    }
    types = [key[1] for key in inputs]
    matches = []
    for packet_name in _functional_packets(name, sig.is_inplace):
        packet = getattr(namespace, packet_name, None)
        if packet is None:
            continue
        for overload_name in packet.overloads():
            candidate = getattr(packet, overload_name)
            if signature(candidate).written:
                continue
            keys = [_argument_key(a) for a in candidate._schema.arguments]
            if sorted(keys) == sorted(inputs):
                order = tuple(inputs[k] for k in keys)
            elif [key[1] for key in keys] == types:
                # Same types in the same order under other names (`dropout_(self)`, `dropout(input)`).
                order = tuple(inputs.values())
            else:
                continue
            # Prefer matching names, then the same overload name, then the same argument order.
            by_name = sorted(keys) == sorted(inputs)
            rank = (not by_name, overload_name != op._overloadname, order != tuple(sorted(order)))
            matches.append((rank, str(candidate), candidate, order))
    if not matches:
        return None
    _, _, candidate, order = min(matches, key=lambda m: (m[0], m[1]))
    return candidate, order


def functional_variant(op: OpOverload) -> OpOverload | None:
    """The functional overload computing the values an in-place or `out=` overload writes.

    Found by argument schema, not by overload name: `aten.add_.Tensor` -> `aten.add.Tensor`,
    `aten.pow_.Scalar` -> `aten.pow.Tensor_Scalar`, `aten.bernoulli_.float` -> `aten.bernoulli.p`,
    `aten.normal_.default` -> `aten.normal_functional.default`, `aten.add.out` -> `aten.add.Tensor`.
    A functional op is its own variant. None if there is none.
    """
    form = _functional_form(op)
    return form[0] if form is not None else None


def functional_arguments(op: OpOverload, values: Sequence[T]) -> list[T]:
    """`op`'s schema-ordered argument `values` as its functional variant takes them: `out=`
    arguments dropped, the rest in the functional schema's order."""
    form = _functional_form(op)
    if form is None:
        raise ValueError(f"{op} has no functional variant")
    return [values[i] for i in form[1]]
