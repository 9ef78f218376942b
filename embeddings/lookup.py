"""The fused lookup of one stack as an autograd function: the forward runs
`torch.ops.tpu.sparse_dense_matmul`; the backward runs the stack's update,
`torch.ops.tpu.sparse_dense_matmul_grad_with_<optimizer>_`, in place on the module's table,
slots, update count and gradient workspace. So the optimizer is applied during
`loss.backward()`, and the table never gets a `.grad` (its gradient is returned as None). The
eager executors donate the table's buffer to the update, which scatters into it: no table-sized
copy per step.

Inside `torch.compile` graphs the functional update runs and its results are `copy_`d into the
state: AOTAutograd keeps those writes as the backward graph's input mutations, which the tpu
backend performs in place (donated) too.
"""

from __future__ import annotations

from typing import Any

import torch

from embeddings.ops import BUFFERS, StackComputation, sparse_dense_matmul, update_kernel
from embeddings.state import StackedState

__all__ = ["fused_lookup"]


class _FusedLookup(torch.autograd.Function):
    """`(computation, table, *buffers, *slots, step, *hyper-parameters, workspace) -> activations`."""

    @staticmethod
    def forward(ctx: Any, computation: StackComputation, table: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.computation = computation
        ctx.save_for_backward(table, *inputs)
        return sparse_dense_matmul(*inputs[:4], table, **computation.static_args)

    @staticmethod
    def backward(ctx: Any, activations_grad: torch.Tensor) -> tuple[None, ...]:
        computation: StackComputation = ctx.computation
        table, *inputs = ctx.saved_tensors
        buffers, rest = inputs[: len(BUFFERS)], inputs[len(BUFFERS) :]
        num_slots = len(computation.optimizer.slots())
        slots, step = rest[:num_slots], rest[num_slots]
        hyperparameters, workspace = rest[num_slots + 1 : -1], rest[-1]
        kernel = update_kernel(computation.optimizer)
        args = (*buffers, table, *slots, step, activations_grad, *hyperparameters, workspace)
        with torch.no_grad():
            if torch.compiler.is_compiling():
                updated = kernel(*args, **computation.static_args)
                for target, value in zip((table, *slots, step, workspace), updated):
                    target.copy_(value)
            else:
                kernel.inplace(*args, **computation.static_args)
        return (None,) * (2 + len(inputs))


def fused_lookup(computation: StackComputation, state: StackedState, buffers: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The stack's activations `[N * B, D]` (SparseCore-major) for one batch's `buffers` (in
    `embeddings.ops.BUFFERS` order); differentiable, with the update fused into the backward."""
    stack = computation.stack.name
    return _FusedLookup.apply(
        computation,
        state.table(stack),
        *buffers,
        *state.slots(stack),
        state.step(stack),
        *state.hyperparameters(computation.optimizer),
        state.workspace(stack),
    )
