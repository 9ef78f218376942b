"""Ops that run through PyTorch's own decompositions instead of a lowering of their own.

`torch._decomp` writes many ATen ops in terms of simpler ones (the Core ATen opset). An op with
no lowering here but a decomposition there runs as that decomposition: its pieces dispatch to
the `tpu` kernels one by one in strict mode, and are fused into one program in defer and compiled
modes. In-place and `out=` overloads decompose through their functional overload. A few ops
decompose here by compositions of torchtpu's own (`_LOCAL`): batch norm keeping the CPU's saved
statistics, the attention modules' inference fast path (`fastpath`) and SyncBatchNorm's
statistics ops (`sync_batch_norm`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Sequence

import torch
from torch._decomp import decomposition_table
from torch._ops import OpOverload

from torchtpu.ops import registry
from torchtpu.ops.fastpath import FASTPATH
from torchtpu.ops.nn import cpu_saved_statistics
from torchtpu.ops.sync_batch_norm import SYNC_BATCH_NORM
from torchtpu.ops.schema import functional_arguments, functional_variant, signature


def resize_out(out: torch.Tensor, sizes: Sequence[int], strides: Sequence[int] | None = None) -> bool:
    """PyTorch's rule for an `out=` tensor of another shape than the result: resize it (warning
    if it held elements), laid out with `strides` if given. True if it was resized."""
    sizes = tuple(sizes)
    if tuple(out.shape) == sizes:
        return False
    if out.numel() != 0:
        warnings.warn(
            f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
            f"which does not match the required output shape {list(sizes)}. This behavior is "
            "deprecated, and in a future PyTorch release outputs will not be resized unless they "
            "have zero elements. You can explicitly reuse an out tensor t by resizing it, inplace, "
            "to zero elements with t.resize_(0).",
            stacklevel=3,
        )
    out.resize_(sizes)
    if strides is not None and tuple(out.stride()) != tuple(strides):
        out.as_strided_(sizes, tuple(strides))
    return True


def _through_functional(compute: Callable, op: OpOverload) -> Callable:
    """`op` (in-place or `out=`) as its functional variant `compute` plus a write-back."""
    sig, fsig = signature(op), signature(functional_variant(op))

    def run(*args, **kwargs):
        values = sig.normalize(args, kwargs)
        fpos, fkw = fsig.split(functional_arguments(op, values))
        result = compute(*fpos, **fkw)
        written = [values[i] for i in sig.written]
        if sig.is_inplace and isinstance(written[0], (list, tuple)):  # _foreach_*_
            for dst, src in zip(written[0], result):
                dst.copy_(src)
            return None
        results = result if isinstance(result, (tuple, list)) else (result,)
        for dst, src in zip(written, results):
            if sig.is_out:
                resize_out(dst, src.shape)
            dst.copy_(src)
        return written[0] if len(written) == 1 else tuple(written)

    return run


def _saves_as_cpu(decomposition: Callable, training: bool | None = None) -> Callable:
    """Batch norm as PyTorch's decomposition, except that the saved mean and inverse standard
    deviation are what ATen's CPU kernel returns (`nn.cpu_saved_statistics`: empty in eval mode,
    in the input's dtype unless the parameters' differs); the decomposition follows the CUDA
    kernel there. `training` is given for overloads without that argument."""

    def run(input, weight, bias, running_mean, running_var, *args):
        results = decomposition(input, weight, bias, running_mean, running_var, *args)
        mode = args[0] if training is None else training
        saved = cpu_saved_statistics(input, results[1], results[2], mode, weight, bias, running_mean, running_var)
        return (results[0], *saved, *results[3:])

    return run


_aten = torch.ops.aten
_LOCAL = {
    _aten.native_batch_norm.default: _saves_as_cpu(decomposition_table[_aten.native_batch_norm.default]),
    _aten._native_batch_norm_legit.default: _saves_as_cpu(decomposition_table[_aten._native_batch_norm_legit.default]),
    _aten._batch_norm_with_update.default: _saves_as_cpu(decomposition_table[_aten._batch_norm_with_update.default],
                                                         training=True),
    **FASTPATH,  # the attention modules' inference fast path, composed of lowered ops
    **SYNC_BATCH_NORM,  # SyncBatchNorm's statistics ops (CUDA kernels only), composed likewise
}


@functools.lru_cache(maxsize=None)
def get(op: OpOverload) -> Callable[..., Any] | None:
    """The decomposition to run for `op` on `tpu`, or None.

    In-place and `out=` overloads run their functional overload (lowered or decomposed) and
    write the result back, with PyTorch's resize rule for `out=`; PyTorch's own entries for
    those overloads are used only when there is no functional overload to go through.
    """
    if registry.get(op) is not None:
        return None
    if op in _LOCAL:
        return _LOCAL[op]
    sig = signature(op)
    if sig.written:
        functional = functional_variant(op)
        if functional is not None and functional is not op:
            # Call the functional lowering through its kernel, or the functional decomposition
            # directly: PyTorch's C++ functional kernel may itself call this out= overload.
            compute = functional if registry.get(functional) is not None else decomposition_table.get(functional)
            if compute is not None:
                return _through_functional(compute, op)
    return decomposition_table.get(op)


# Functional ops outside the Core ATen opset that eager mode runs as PyTorch's decompositions
# (`get`) and compiled graphs should too, rather than splitting to run them eagerly. Each is
# checked to trace under AOTAutograd (tests/torchtpu/test_compile.py): a decomposition that
# writes in place (`polar`'s) does not, which is why this is a list and not every entry of
# `decomposition_table`.
_COMPILE_ALSO = (
    _aten.dist.default,
    _aten.narrow_copy.default,
    _aten.new_empty_strided.default,
    _aten._addmm_activation.default,
)


def for_compile() -> dict[OpOverload, Callable[..., Any]]:
    """Decompositions AOTAutograd should apply for `torch.compile(backend="tpu")`, for ops the
    registry does not lower itself: PyTorch's decompositions to the Core ATen opset, and eager's
    of the ops in `_COMPILE_ALSO`."""
    from torch._decomp import core_aten_decompositions

    table = {op: fn for op, fn in core_aten_decompositions().items() if registry.get(op) is None}
    table.update({op: get(op) for op in _COMPILE_ALSO if get(op) is not None})
    return table
