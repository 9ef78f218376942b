"""Activations on `tpu` against PyTorch's CPU kernels, forward and backward: the values at NaN and
at the branch points (0, thresholds, +-3, +-lambda), bfloat16, non-contiguous inputs, gradients
through autograd (which calls the *_backward ops), in-place forms, and hyper-parameters that change
without recompiling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import torchtpu

NAN = math.nan


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


def _tpu(x):
    return x.detach().to("tpu").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


# Branch points of the activations below, NaN, and ordinary values.
POINTS = torch.tensor([-6.0, -3.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 6.0, 25.0, NAN])
RANDOM = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 3

ACTIVATIONS = {
    "relu": F.relu, "relu6": F.relu6, "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "elu": lambda x: F.elu(x, 1.5), "selu": F.selu, "celu": lambda x: F.celu(x, 0.7),
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "mish": F.mish, "softplus": lambda x: F.softplus(x, beta=2, threshold=5),
    "softshrink": lambda x: F.softshrink(x, 0.5), "hardshrink": lambda x: F.hardshrink(x, 0.5),
    "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish, "hardtanh": lambda x: F.hardtanh(x, -2, 1),
    "logsigmoid": F.logsigmoid, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "threshold": lambda x: F.threshold(x, 0.5, -3.0), "logit": lambda x: torch.logit(x.sigmoid()),
    "logit_eps": lambda x: torch.logit(x, eps=0.1), "softsign": F.softsign, "tanhshrink": F.tanhshrink,
    "prelu": lambda x: F.prelu(x, torch.full((1,), 0.25, device=x.device)),
    "glu": lambda x: F.glu(torch.stack([x, x.flip(-1)], -1), dim=-1),
}  # fmt: skip


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_forward_at_branch_points(name):
    fn = ACTIVATIONS[name]
    expected = fn(POINTS)
    torch.testing.assert_close(fn(POINTS.to("tpu")).cpu(), expected, equal_nan=True)


@pytest.mark.parametrize("name", ["gelu", "silu", "hardswish", "elu", "softplus", "logsigmoid", "leaky_relu"])
def test_forward_bf16_and_noncontiguous(name):
    fn = ACTIVATIONS[name]
    bf16 = RANDOM.to(torch.bfloat16)
    torch.testing.assert_close(fn(bf16.to("tpu")).cpu(), fn(bf16), rtol=1.6e-2, atol=1e-2)
    strided = RANDOM.t()[::2]
    torch.testing.assert_close(fn(strided.to("tpu")).cpu(), fn(strided))


def _gradients(fn, x, grad_out):
    x = x.detach().requires_grad_(True)
    y = fn(x)
    (grad,) = torch.autograd.grad(y, x, grad_out)
    return grad


# Branch points are excluded here: CPU and tpu agree on them in forward, but gradients at a kink
# are conventions; POINTS checks them below for the ops whose backward has its own kernel.
@pytest.mark.parametrize("name", [n for n in ACTIVATIONS if n != "logit"])
def test_backward_matches_cpu(name):
    fn = ACTIVATIONS[name]
    x = RANDOM + 0.01
    grad_out = torch.linspace(-1, 1, fn(x).numel()).reshape(fn(x).shape)
    expected = _gradients(fn, x, grad_out)
    actual = _gradients(fn, x.to("tpu"), grad_out.to("tpu")).cpu()
    torch.testing.assert_close(actual, expected, equal_nan=True)


BACKWARD_AT_POINTS = {
    "threshold_backward": lambda g, x: torch.ops.aten.threshold_backward(g, x, 0.5),
    "hardtanh_backward": lambda g, x: torch.ops.aten.hardtanh_backward(g, x, -2.0, 1.0),
    "leaky_relu_backward": lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, 0.2, False),
    "elu_backward_input": lambda g, x: torch.ops.aten.elu_backward(g, 1.5, 1.0, 1.0, False, x),
    "elu_backward_result": lambda g, x: torch.ops.aten.elu_backward(g, 1.5, 1.0, 1.0, True, F.elu(x, 1.5)),
    "gelu_backward": lambda g, x: torch.ops.aten.gelu_backward(g, x),
    "gelu_backward_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "softplus_backward": lambda g, x: torch.ops.aten.softplus_backward(g, x, 2.0, 5.0),
    "sigmoid_backward": lambda g, x: torch.ops.aten.sigmoid_backward(g, x.sigmoid()),
    "tanh_backward": lambda g, x: torch.ops.aten.tanh_backward(g, x.tanh()),
    "hardsigmoid_backward": lambda g, x: torch.ops.aten.hardsigmoid_backward(g, x),
    "hardswish_backward": lambda g, x: torch.ops.aten.hardswish_backward(g, x),
    "softshrink_backward": lambda g, x: torch.ops.aten.softshrink_backward(g, x, 0.5),
    "hardshrink_backward": lambda g, x: torch.ops.aten.hardshrink_backward(g, x, 0.5),
    "logit_backward": lambda g, x: torch.ops.aten.logit_backward(g, x / 4 + 0.5),
    "logit_backward_eps": lambda g, x: torch.ops.aten.logit_backward(g, x / 4 + 0.5, 0.2),
    "log_sigmoid_backward": lambda g, x: torch.ops.aten.log_sigmoid_backward(
        g, x, torch.ops.aten.log_sigmoid_forward(x)[1]
    ),
    "prelu_kernel_backward": lambda g, x: torch.ops.aten._prelu_kernel_backward(g, x, torch.full((1,), 0.3, device=x.device)),
    "rrelu_with_noise_backward": lambda g, x: torch.ops.aten.rrelu_with_noise_backward(
        g, x, torch.ones_like(x) * 0.2, 0.1, 0.3, False, False
    ),
    "rrelu_with_noise_backward_training": lambda g, x: torch.ops.aten.rrelu_with_noise_backward(
        g, x, torch.where(x > 0, 1.0, 0.2), 0.1, 0.3, True, False
    ),
}


@pytest.mark.parametrize("name", BACKWARD_AT_POINTS)
def test_backward_ops_at_branch_points(name):
    fn = BACKWARD_AT_POINTS[name]
    grad = torch.linspace(-1, 2, POINTS.numel())
    expected = fn(grad, POINTS)
    actual = tree_map(_cpu, fn(grad.to("tpu"), POINTS.to("tpu")))
    torch.testing.assert_close(actual, expected, equal_nan=True)


def test_glu_backward_on_every_dim():
    x = torch.randn(4, 6, 2, generator=torch.Generator().manual_seed(2))
    for dim in (0, 1, -1):
        grad = torch.ones_like(F.glu(x, dim))
        expected = torch.ops.aten.glu_backward(grad, x, dim)
        actual = torch.ops.aten.glu_backward(grad.to("tpu"), x.to("tpu"), dim).cpu()
        torch.testing.assert_close(actual, expected)


def test_inplace_activations():
    def run(x):
        x = x.clone()
        F.relu_(x[0])
        F.leaky_relu_(x[1], 0.3)
        F.hardtanh_(x[2], -1.0, 0.5)
        F.elu_(x[3])
        return x

    torch.testing.assert_close(run(RANDOM.to("tpu")).cpu(), run(RANDOM))


def test_rrelu_with_noise_functional_samples_within_bounds():
    x = torch.randn(2000, generator=torch.Generator().manual_seed(3)).to("tpu")
    out, noise = torch.ops.aten.rrelu_with_noise_functional(x, torch.empty_like(x), 0.1, 0.3, True)
    out, noise, x = out.cpu(), noise.cpu(), x.cpu()
    positive = x > 0
    assert torch.equal(noise[positive], torch.ones(int(positive.sum())))
    assert noise[~positive].min() >= 0.1 and noise[~positive].max() <= 0.3
    assert noise[~positive].std() > 0.04  # drawn, not a constant slope
    torch.testing.assert_close(out, x * noise)
    out, noise = torch.ops.aten.rrelu_with_noise_functional(x.to("tpu"), torch.empty_like(x).to("tpu"), 0.1, 0.3)
    torch.testing.assert_close(out.cpu(), F.leaky_relu(x, 0.2))


def test_rrelu_training_draws_slopes_and_backpropagates_them():
    x = torch.randn(500, generator=torch.Generator().manual_seed(4)).to("tpu").requires_grad_()
    out = F.rrelu(x, 0.1, 0.3, training=True)
    out.sum().backward()
    slope = (out / x).detach().cpu()
    negative = (x < 0).cpu()
    assert slope[negative].min() >= 0.1 and slope[negative].max() <= 0.3
    torch.testing.assert_close(slope[~negative], torch.ones(int((~negative).sum())))
    torch.testing.assert_close(x.grad.cpu(), slope)  # d(x * slope)/dx = the drawn slope
    evaluation = F.rrelu(x.detach(), 0.1, 0.3, training=False)
    torch.testing.assert_close(evaluation.cpu(), F.leaky_relu(x.detach().cpu(), 0.2))
    inplace = x.detach().clone()
    assert F.rrelu_(inplace, 0.1, 0.3, training=True) is inplace
    drawn = (inplace / x.detach()).cpu()
    assert drawn[negative].min() >= 0.1 and drawn[negative].max() <= 0.3


def test_changing_hyperparameters_does_not_recompile():
    x = RANDOM.to("tpu")
    F.leaky_relu(x, 0.1), F.elu(x, 0.5), F.softplus(x, 2.0, 10.0), F.hardtanh(x, -0.5, 0.5)
    torchtpu.reset_metrics()
    result = F.leaky_relu(x, 0.3), F.elu(x, 1.5), F.softplus(x, 3.0, 8.0), F.hardtanh(x, -2.0, 1.0)
    assert torchtpu.metrics().get("eager_programs", 0) == 0
    torch.testing.assert_close(result[1].cpu(), F.elu(RANDOM, 1.5))
