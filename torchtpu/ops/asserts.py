"""Device-side assertions: `torch._assert_async` and the forms compiled graphs carry.

`torch._assert_async(cond, msg)` is CUDA's device-side assert: the host does not wait for
`cond`. On tpu it is a device-side check (`torchtpu.exec.checks`): the program computes the flag
beside its results, and a false `cond` raises `DeviceCheckError` with `msg` at the next point
where the host waits for the device anyway. Compiled graphs carry the same assertion from
PyTorch's decompositions (`F.one_hot` checks its class values with it), and its functional form,
which threads a dependency token (`_make_dep_token`, a tensor whose value is never read)
through the checks.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchtpu.ops import registry

aten = torch.ops.aten

_DEFAULT_MESSAGE = "Expected Tensor with single nonzero value, but got zero"  # PyTorch's own


def _one_value(self: torch.Tensor, *args, **kwargs) -> None:
    """PyTorch's check that the condition holds one value (a metadata check, made on the host)."""
    if self.numel() != 1:
        amount = "no values" if self.numel() == 0 else "more than one value"
        raise RuntimeError(f"Boolean value of Tensor with {amount} is ambiguous")


def _true(cond):
    """The one-element `cond` is true: nonzero, as PyTorch reads it."""
    return cond.reshape(()) != 0


@registry.register(aten._assert_async.default, validate=_one_value)
def assert_async(ctx, cond) -> tuple:
    ctx.check(_true(cond), _DEFAULT_MESSAGE)
    return ()


@registry.register(aten._assert_async.msg, validate=_one_value)
def assert_async_msg(ctx, cond, assert_msg: str) -> tuple:
    ctx.check(_true(cond), assert_msg)
    return ()


@registry.register(aten._functional_assert_async.msg, validate=_one_value)
def functional_assert_async(ctx, cond, assert_msg: str, dep_token):
    ctx.check(_true(cond), assert_msg)
    return dep_token


@registry.register(aten._make_dep_token.default)
def make_dep_token(ctx, **_):
    return jnp.zeros(ctx.out_shape(), ctx.out_dtype())
