"""`torch.autocast("tpu")`: CUDA's cast policy on tpu tensors, against PyTorch on CPU.

Each op's reference is the CPU op on the inputs the policy casts to: matmuls and convolutions in
the autocast dtype, accuracy-sensitive ops in float32, mixed inputs promoted."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchtpu

MODES = ["strict", "defer"]


def _inputs(*shapes, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in shapes]


LOWER_PRECISION = {
    "mm": (lambda a, b: a @ b, [(8, 16), (16, 4)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(8, 16), (4, 16), (4,)]),
    "bmm": (torch.bmm, [(2, 8, 16), (2, 16, 4)]),
    "addmm": (torch.addmm, [(8, 4), (8, 16), (16, 4)]),
    "conv2d": (lambda x, w: F.conv2d(x, w, padding=1), [(2, 3, 8, 8), (4, 3, 3, 3)]),
}

FLOAT32 = {
    "softmax": (lambda x: torch.softmax(x, -1), [(8, 16)]),
    "log_softmax": (lambda x: F.log_softmax(x, -1), [(8, 16)]),
    "exp": (torch.exp, [(8, 16)]),
    "layer_norm": (lambda x: F.layer_norm(x, (16,)), [(8, 16)]),
    "mse_loss": (F.mse_loss, [(8, 16), (8, 16)]),
    "sum": (torch.sum, [(8, 16)]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(LOWER_PRECISION))
def test_matmuls_and_convolutions_run_in_the_autocast_dtype(name, dtype, mode):
    op, shapes = LOWER_PRECISION[name]
    args = _inputs(*shapes)
    expected = op(*(a.to(dtype) for a in args))
    with torchtpu.eager_mode(mode), torch.autocast("tpu", dtype=dtype):
        actual = op(*(a.to("tpu") for a in args))
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.cpu(), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(FLOAT32))
def test_accuracy_sensitive_ops_run_in_float32(name, mode):
    op, shapes = FLOAT32[name]
    args = [a.bfloat16() for a in _inputs(*shapes)]  # 16-bit activations, as after a matmul
    expected = op(*(a.float() for a in args))
    with torchtpu.eager_mode(mode), torch.autocast("tpu"):
        actual = op(*(a.to("tpu") for a in args))
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.cpu(), expected)


def test_mixed_inputs_are_promoted_and_other_ops_pass_through():
    a, b, c = _inputs((4, 4), (4, 4), (4, 4))
    with torch.autocast("tpu"):
        mixed = torch.addcmul(a.to("tpu"), b.bfloat16().to("tpu"), c.to("tpu"))
        untouched = torch.relu(b.bfloat16().to("tpu"))
    assert mixed.dtype == torch.float32 and untouched.dtype == torch.bfloat16
    torch.testing.assert_close(mixed.cpu(), torch.addcmul(a, b.bfloat16().float(), c))


def test_bfloat16_is_the_default_and_autocast_can_be_switched_off():
    a, b = (t.to("tpu") for t in _inputs((4, 8), (8, 4)))
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16
    assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]
    with torch.autocast("tpu"):
        assert torch.is_autocast_enabled("tpu")
        assert (a @ b).dtype == torch.bfloat16
        with torch.autocast("tpu", enabled=False):
            assert (a @ b).dtype == torch.float32
    assert (a @ b).dtype == torch.float32


def test_binary_cross_entropy_is_refused_as_on_cuda():
    p, target = torch.rand(8).to("tpu"), torch.ones(8).to("tpu")
    with torch.autocast("tpu"), pytest.raises(RuntimeError, match="unsafe to autocast on tpu"):
        F.binary_cross_entropy(p, target)
    with torch.autocast("tpu"):
        loss = F.binary_cross_entropy_with_logits(p, target)
    torch.testing.assert_close(loss.cpu(), F.binary_cross_entropy_with_logits(p.cpu(), target.cpu()))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _train(model: nn.Module, device: str, compiled: bool = False) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(model, backend="tpu") if compiled else model
    losses = []
    for step in range(3):
        x, y = _inputs((16, 32), (16, 10), seed=step)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = forward(x.to(device))
            assert out.dtype == torch.bfloat16
            loss = F.mse_loss(out, y.to(device))
        assert loss.dtype == torch.float32
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["strict", "defer", "compiled"])
def test_a_model_trains_under_autocast_like_cpu(mode):
    torch.manual_seed(0)
    reference = _MLP()
    model = copy.deepcopy(reference).to("tpu")
    expected = _train(reference, "cpu")  # CPU's own autocast: the same linears in bfloat16
    with torchtpu.eager_mode("strict" if mode == "compiled" else mode):
        actual = _train(model, "tpu", compiled=mode == "compiled")
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=0)
    for p_cpu, p_tpu in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu, rtol=1e-2, atol=1e-3)
