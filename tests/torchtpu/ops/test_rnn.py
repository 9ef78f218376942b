"""`nn.LSTM`, `nn.GRU` and their cells on `tpu` (the fused cell ops and their gradients) against
PyTorch's CPU modules, which run unfused cells: outputs, final states and every gradient --
of the input, the initial states and each weight and bias -- with and without biases, in strict
and defer mode, at the highest matmul precision (the gate matmuls are ordinary `mm`s)."""

from __future__ import annotations

import pytest
import torch

import torchtpu
from test_reduction import strict_ops  # noqa: F401  (the autouse fixture: no CPU fallback)

MODES = ["strict", "defer"]


def _loss(outputs) -> torch.Tensor:
    """A loss that reaches every output of the module (LSTM's cell state included), each with
    its own weight so that no gradient is the same for all elements."""
    flat = [outputs] if isinstance(outputs, torch.Tensor) else [t for o in outputs
                                                                for t in ([o] if isinstance(o, torch.Tensor) else o)]
    return sum((t * torch.linspace(-1, 1, t.numel(), device=t.device).reshape(t.shape)).pow(2).sum() for t in flat)


def _run(module: torch.nn.Module, inputs: list[torch.Tensor], device: str):
    module = module.to(device)
    leaves = [x.detach().to(device).requires_grad_() for x in inputs]
    outputs = module(leaves[0], tuple(leaves[1:]) if len(leaves) > 2 else (leaves[1] if len(leaves) > 1 else None))
    _loss(outputs).backward()
    flat = [outputs] if isinstance(outputs, torch.Tensor) else [t for o in outputs
                                                                for t in ([o] if isinstance(o, torch.Tensor) else o)]
    return ([t.detach().cpu() for t in flat] + [x.grad.cpu() for x in leaves]
            + [p.grad.cpu() for p in module.parameters()])


def _case(name: str, bias: bool):
    g = torch.Generator().manual_seed(0)
    batch, features, hidden = 3, 6, 5
    x_seq, x_one = torch.randn(batch, 4, features, generator=g), torch.randn(batch, features, generator=g)
    h0 = torch.randn(2, batch, hidden, generator=g)
    c0 = torch.randn(2, batch, hidden, generator=g)
    torch.manual_seed(1)
    return {
        "LSTM": (torch.nn.LSTM(features, hidden, num_layers=2, batch_first=True, bias=bias), [x_seq, h0, c0]),
        "GRU": (torch.nn.GRU(features, hidden, num_layers=2, batch_first=True, bias=bias), [x_seq, h0]),
        "LSTMCell": (torch.nn.LSTMCell(features, hidden, bias=bias), [x_one, h0[0], c0[0]]),
        "GRUCell": (torch.nn.GRUCell(features, hidden, bias=bias), [x_one, h0[0]]),
    }[name]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", ["LSTM", "GRU", "LSTMCell", "GRUCell"])
def test_recurrent_modules_match_cpu(name, bias, mode):
    module, inputs = _case(name, bias)
    reference = _run(module, inputs, "cpu")
    module.zero_grad()
    with torchtpu.eager_mode(mode), torch.tpu.precision("highest"):
        actual = _run(module, inputs, "tpu")
    assert len(actual) == len(reference)
    for got, want in zip(actual, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lstm_without_initial_state_or_with_only_the_output_used():
    """No initial state (zeros), and a loss on the output alone: the cell's backward then gets
    no gradient for the last cell state."""
    module, (x, _, _) = _case("LSTM", True)
    results = {}
    for device in ("cpu", "tpu"):
        module.zero_grad()  # before moving it: `to` would move the gradients kept from the CPU run too
        m = module.to(device)
        leaf = x.detach().to(device).requires_grad_()
        with torch.tpu.precision("highest"):
            m(leaf)[0].pow(2).sum().backward()
        results[device] = [leaf.grad.cpu()] + [p.grad.cpu() for p in m.parameters()]
    for got, want in zip(results["tpu"], results["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
