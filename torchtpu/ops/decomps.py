"""Ops that run through PyTorch's own decompositions instead of a lowering of their own.

`torch._decomp` writes many ATen ops in terms of simpler ones (the Core ATen opset). An op with
no lowering here but a decomposition there runs as that decomposition: its pieces dispatch to
the `tpu` kernels one by one in strict mode, and are fused into one program in defer and compiled
modes. In-place and `out=` overloads decompose through their functional overload.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._decomp import decomposition_table
from torch._ops import OpOverload

from torchtpu.ops import registry
from torchtpu.ops.schema import functional_variant, signature


def _inplace(functional: Callable, op: OpOverload) -> Callable:
    def run(*args, **kwargs):
        result = functional(*args, **kwargs)
        self = args[0] if args else kwargs["self"]
        if isinstance(self, (list, tuple)):
            for dst, src in zip(self, result):
                dst.copy_(src)
            return None
        return self.copy_(result)

    return run


def _out(functional: Callable, op: OpOverload) -> Callable:
    sig = signature(op)
    out_names = [a.name for a in sig.args if a.writes]

    def run(*args, **kwargs):
        outs = [kwargs.pop(name) for name in out_names]
        result = functional(*args, **kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for dst, src in zip(outs, results):
            if dst.shape != src.shape:
                dst.resize_(src.shape)
            dst.copy_(src)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


@functools.lru_cache(maxsize=None)
def get(op: OpOverload) -> Callable[..., Any] | None:
    """The decomposition to run for `op` on `tpu`, or None.

    In-place and `out=` overloads run their functional overload (lowered or decomposed) and
    write the result back, with PyTorch's resize rule for `out=`; PyTorch's own entries for
    those overloads are used only when there is no functional overload to go through.
    """
    if registry.get(op) is not None:
        return None
    sig = signature(op)
    if sig.written:
        functional = functional_variant(op)
        if functional is not None and functional is not op:
            # Call the functional lowering through its kernel, or the functional decomposition
            # directly: PyTorch's C++ functional kernel may itself call this out= overload.
            compute = functional if registry.get(functional) is not None else decomposition_table.get(functional)
            if compute is not None:
                return _out(compute, op) if sig.is_out else _inplace(compute, op)
    return decomposition_table.get(op)


def for_compile() -> dict[OpOverload, Callable[..., Any]]:
    """Decompositions AOTAutograd should apply for `torch.compile(backend="tpu")`: PyTorch's
    decompositions to the Core ATen opset, for ops the registry does not lower itself."""
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if registry.get(op) is None}
