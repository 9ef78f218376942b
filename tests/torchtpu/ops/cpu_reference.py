"""Checks shared by the indexing, shape and data-dependent op tests: run a function on CPU
tensors and on `tpu` copies of them, and compare (values, dtypes and shapes; gradients)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    """A CPU fallback is not coverage: any op without a lowering fails the test."""
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


def to(device: str):
    return lambda x: x.to(device) if isinstance(x, torch.Tensor) else x


def same_as_cpu(fn, *args, exact: bool = True) -> None:
    """`fn` on `tpu` copies of `args` equals `fn` on the CPU originals, bit for bit unless
    `exact=False` (then within float32 / bfloat16 default tolerances)."""
    expected = fn(*args)
    actual = tree_map(to("cpu"), fn(*tree_map(to("tpu"), args)))
    tolerance = dict(rtol=0, atol=0) if exact else {}
    torch.testing.assert_close(actual, expected, equal_nan=True, **tolerance)


def grads_same_as_cpu(fn, *inputs: torch.Tensor) -> None:
    """Gradients of sum(fn(*inputs) * cotangent) for the floating-point inputs, on `tpu` and on
    CPU, agree (NaN where CPU has NaN)."""
    positions = [i for i, x in enumerate(inputs) if x.is_floating_point()]

    def grads(device):
        moved = [x.detach().to(device) for x in inputs]
        for i in positions:
            moved[i].requires_grad_()
        out = fn(*moved)
        cotangent = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).reshape(out.shape)
        leaves = [moved[i] for i in positions]
        return tree_map(to("cpu"), torch.autograd.grad(out, leaves, cotangent.to(device)))

    torch.testing.assert_close(grads("tpu"), grads("cpu"), equal_nan=True)
