"""Small models train on `tpu` exactly as on CPU: an MLP, a CNN and a pre-LN transformer block,
20 Adam steps under `highest` precision, losses within 1e-4 relative -- in every execution mode."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import torchtpu

STEPS = 20


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv, batchnorm, pooling. The convolutions have no bias, as is usual before batchnorm: a bias
    there has a gradient of zero up to rounding, so Adam would steer it by the sign of rounding noise
    and make it differ between any two devices."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.AvgPool2d(2),
        )
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class PreLNBlock(nn.Module):
    """Pre-LN transformer block: LayerNorm, softmax attention, GELU MLP (dropout off). The query/key/value
    projection has no bias (as in LLaMA): softmax ignores a key bias, so its gradient is rounding noise
    that Adam would amplify into different parameters on any two devices."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.out = nn.Linear(dim, 10)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return self.out(x.mean(dim=1))


def _data(model_name: str, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    if model_name == "mlp":
        x = torch.randn(16, 32, generator=g)
    elif model_name == "cnn":
        x = torch.randn(8, 3, 16, 16, generator=g)
    else:
        x = torch.randn(4, 12, 32, generator=g)
    y = torch.randint(0, 10, (x.shape[0],), generator=g)
    return x, y


MODELS = {"mlp": MLP, "cnn": SmallCNN, "transformer": PreLNBlock}


def _train(model: nn.Module, model_name: str, device: str, compiled: bool = False) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    forward = torch.compile(model, backend="tpu") if compiled else model
    losses = []
    for step in range(STEPS):
        x, y = _data(model_name, step)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["strict", "defer", "compiled"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_training_matches_cpu(model_name, mode):
    torch.manual_seed(0)
    reference = MODELS[model_name]()
    model = copy.deepcopy(reference).to("tpu")
    expected = _train(reference, model_name, "cpu")
    with torch.tpu.precision("highest"), torchtpu.eager_mode("strict" if mode == "compiled" else mode):
        actual = _train(model, model_name, "tpu", compiled=(mode == "compiled"))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=0)
    for (name, p_cpu), p_tpu in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("optimizer_name", ["SGD", "Adam", "AdamW", "Adagrad"])
@pytest.mark.parametrize("foreach", [False, True])
def test_optimizers_step_like_cpu(optimizer_name, foreach):
    torch.manual_seed(0)
    reference = MLP()
    model = copy.deepcopy(reference).to("tpu")
    kwargs = {"lr": 0.01, "foreach": foreach}
    if optimizer_name == "SGD":
        kwargs["momentum"] = 0.9
    opt_cpu = getattr(torch.optim, optimizer_name)(reference.parameters(), **kwargs)
    opt_tpu = getattr(torch.optim, optimizer_name)(model.parameters(), **kwargs)
    with torch.tpu.precision("highest"):
        for step in range(3):
            x, y = _data("mlp", step)
            for m, opt, dev in ((reference, opt_cpu, "cpu"), (model, opt_tpu, "tpu")):
                opt.zero_grad()
                nn.functional.cross_entropy(m(x.to(dev)), y.to(dev)).backward()
                opt.step()
    for p_cpu, p_tpu in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu, rtol=1e-4, atol=1e-6)
    state_cpu, state_tpu = opt_cpu.state_dict(), opt_tpu.state_dict()
    for key in state_cpu["state"]:
        for name, value in state_cpu["state"][key].items():
            other = state_tpu["state"][key][name]
            torch.testing.assert_close(other.cpu() if isinstance(other, torch.Tensor) else other,
                                       value, rtol=1e-4, atol=1e-6)


def test_state_dict_roundtrip():
    model = MLP().to("tpu")
    state = model.state_dict()
    assert all(v.device.type == "tpu" for v in state.values())
    fresh = MLP().to("tpu")
    fresh.load_state_dict(state)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a.cpu(), b.cpu())
    cpu_model = MLP()
    cpu_model.load_state_dict({k: v.cpu() for k, v in state.items()})
    x = torch.randn(4, 32)
    with torch.tpu.precision("highest"):
        torch.testing.assert_close(model(x.to("tpu")).cpu(), cpu_model(x), rtol=1e-5, atol=1e-6)
