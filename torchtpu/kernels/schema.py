"""A kernel function's Python signature as a torch op schema.

Positional parameters are tensors; keyword-only parameters are static values whose type comes
from their annotation or default: `int`, `float`, `bool`, `str` or a tuple/list of ints.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

_STATIC_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}
_ANNOTATION_NAMES = {"int": int, "float": float, "bool": bool, "str": str}


@dataclass(frozen=True)
class KernelSignature:
    """Names of the tensor parameters, the static parameters, and the op schema's arguments."""

    tensors: tuple[str, ...]
    statics: tuple[inspect.Parameter, ...]
    schema_args: str
    static_schema: str  # the keyword-only part of `schema_args` ("" without statics)

    def inplace_schema_args(self, mutated: Sequence[str]) -> str:
        """`schema_args` with the tensors `mutated` marked as written (`Tensor(a!)`, `Tensor(b!)`, ...)."""
        aliases = {name: chr(ord("a") + i) for i, name in enumerate(mutated)}
        parts = [f"Tensor({aliases[n]}!) {n}" if n in aliases else f"Tensor {n}" for n in self.tensors]
        return ", ".join(parts + ([self.static_schema] if self.static_schema else []))


def _static_type(param: inspect.Parameter, kernel: str) -> str:
    annotation = param.annotation
    if isinstance(annotation, str):
        annotation = _ANNOTATION_NAMES.get(annotation, annotation)
    if annotation is inspect.Parameter.empty and param.default is not inspect.Parameter.empty:
        annotation = type(param.default)
    if annotation in _STATIC_TYPES:
        return _STATIC_TYPES[annotation]
    if annotation in (tuple, list) or str(annotation).startswith(("tuple[int", "list[int")):
        return "int[]"
    raise TypeError(
        f"kernel {kernel}: static parameter {param.name!r} needs an int, float, bool, str or "
        f"int-tuple annotation or default"
    )


def _schema_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return repr(value).replace("'", '"')
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return repr(value)


def kernel_signature(fn: Callable[..., Any], kernel: str) -> KernelSignature:
    """The signature of `fn` as kernel `kernel`'s op arguments."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError(f"kernel {kernel}: *args/**kwargs are not supported; name every parameter")
    tensors = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    statics = [p for p in params if p.kind is p.KEYWORD_ONLY]
    static_parts = []
    if statics:
        static_parts.append("*")
        for p in statics:
            entry = f"{_static_type(p, kernel)} {p.name}"
            if p.default is not inspect.Parameter.empty:
                entry += f"={_schema_literal(p.default)}"
            static_parts.append(entry)
    parts = [f"Tensor {name}" for name in tensors] + static_parts
    return KernelSignature(tuple(tensors), tuple(statics), ", ".join(parts), ", ".join(static_parts))
