"""Bounded dynamism: a batch size or sequence length declared with `torchtpu.bounded` compiles one
program per bucket, and every result equals PyTorch CPU's unpadded computation."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchtpu
from torchtpu.exec.bucketing import BucketingError
from test_training import PreLNBlock


def test_buckets_are_powers_of_two_or_the_given_sizes():
    powers = torchtpu.Buckets()
    assert [powers.bucket(n) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    listed = torchtpu.Buckets([48, 16, 200])
    assert [listed.bucket(n) for n in (1, 16, 17, 200)] == [16, 16, 48, 200]
    with pytest.raises(ValueError, match="size 201 exceeds its bound 200"):
        listed.bucket(201)
    with pytest.raises(ValueError, match="at least one entry"):
        powers.bucket(0)


def test_bounded_stores_padding_after_the_true_entries():
    x = torch.arange(15.0).reshape(5, 3)
    t = torchtpu.bounded(x, dim=0)
    assert t.shape == (5, 3) and t.device.type == "tpu"
    assert torch.equal(t.cpu(), x)
    assert t.untyped_storage().nbytes() == 8 * 3 * 4  # bucket 8
    whole = torch.empty(0, device="tpu").set_(t.untyped_storage(), 0, (8, 3), (3, 1))
    assert torch.equal(whole.cpu()[5:], x[:1].expand(3, 3))  # pad rows repeat the first row
    assert set(torchtpu.bounds.bounds_of(t)) == {0}
    with pytest.raises(ValueError, match="pads on the host"):
        torchtpu.bounded(t, dim=0)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def _loss(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def _graph_programs(kind: str) -> int:
    by_op = torchtpu.metrics().get("eager_programs_by_op", {})
    return sum(n for name, n in by_op.items() if name.startswith(kind))


@pytest.mark.parametrize("mode", ["defer", pytest.param("compiled", marks=pytest.mark.slow)])
def test_random_batch_sizes_compile_one_program_per_bucket_and_match_cpu(mode):
    """100 SGD steps with batch sizes drawn from 1..256: at most 9 programs (buckets 1, 2, 4, ...,
    256), each step's loss and updated parameters equal to CPU's. (SGD without momentum: an
    optimizer with state compiles its first step once more, when it creates the state.)"""
    torch.manual_seed(0)
    reference = _mlp()
    model = copy.deepcopy(reference).to("tpu")
    opt_cpu = torch.optim.SGD(reference.parameters(), lr=0.05)
    opt_tpu = torch.optim.SGD(model.parameters(), lr=0.05)
    step = torch.compile(_loss, backend="tpu")
    draw = random.Random(0)
    torch._dynamo.reset()
    torchtpu.reset_metrics()
    with torch.tpu.precision("highest"), torchtpu.eager_mode("defer" if mode == "defer" else "strict"):
        for _ in range(100):
            n = draw.randint(1, 256)
            x, y = torch.randn(n, 32), torch.randint(0, 10, (n,))
            opt_cpu.zero_grad()
            opt_tpu.zero_grad()
            expected = _loss(reference, x, y)
            opt_cpu.step()
            actual = step(model, torchtpu.bounded(x, 0), torchtpu.bounded(y, 0))
            opt_tpu.step()
            torch.testing.assert_close(actual.cpu(), expected.detach(), msg=f"loss at batch size {n}")
            for p_tpu, p_cpu in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p_tpu.cpu(), p_cpu, msg=f"parameters after batch size {n}")
    metrics = torchtpu.metrics()
    if mode == "defer":
        assert metrics["defer_compiles"] <= 9
    else:
        assert _graph_programs("forward_graph") <= 9 and _graph_programs("backward_graph") <= 9


def test_bounded_sequence_length_masks_attention_and_means():
    """One sequence of bounded length through a pre-LN transformer block: softmax over padded
    keys, contractions and a mean over the sequence, forward and backward."""
    torch.manual_seed(0)
    reference = PreLNBlock()
    model = copy.deepcopy(reference).to("tpu")
    forward = torch.compile(lambda m, x: m(x).square().sum(), backend="tpu")
    torch._dynamo.reset()
    with torch.tpu.precision("highest"):
        for length in (3, 7):
            x = torch.randn(1, length, 32)
            reference.zero_grad()
            model.zero_grad()
            expected = reference(x).square().sum()
            expected.backward()
            actual = forward(model, torchtpu.bounded(x, dim=1))
            actual.backward()
            torch.testing.assert_close(actual.detach().cpu(), expected.detach())
            for (name, p_cpu), p_tpu in zip(reference.named_parameters(), model.parameters()):
                torch.testing.assert_close(p_tpu.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-6,
                                           msg=f"{name} at length {length}")


def test_a_bounded_axis_merged_under_another_is_refused():
    """nn.Linear flattens (batch, sequence) into rows: with a bounded sequence inside a batch of
    two, pad rows would sit between real ones, which the masks do not model."""
    model = PreLNBlock().to("tpu")
    forward = torch.compile(model, backend="tpu")
    with pytest.raises(BucketingError, match="puts bounded axis 1 inside another axis"):
        forward(torchtpu.bounded(torch.randn(2, 5, 32), dim=1))


def test_an_op_that_would_mix_pad_rows_is_refused():
    x = torchtpu.bounded(torch.randn(5, 3), 0)
    flipped = torch.compile(lambda t: t.flip(0) * 2, backend="tpu")
    with pytest.raises(BucketingError, match="aten.flip.default reads argument 0 along its bounded axes"):
        flipped(x)
    norm = nn.BatchNorm1d(3).to("tpu")
    with pytest.raises(BucketingError, match="batch_norm"):
        torch.compile(norm, backend="tpu")(torchtpu.bounded(torch.randn(6, 3), 0))


def test_without_bounds_a_new_shape_recompiles_and_the_log_says_which(monkeypatch, capfd):
    monkeypatch.setenv("TORCHTPU_LOG_RECOMPILES", "1")
    double = torch.compile(lambda t: (t * 2).sum(), backend="tpu")
    torch._dynamo.reset()
    for n in (4, 5, 6):
        double(torch.ones(n, 3, device="tpu")).item()
    err = capfd.readouterr().err
    assert "recompiling inference_graph" in err and "(a dynamic size) is 6 instead of 5" in err


def _host_result_beside_the_input(x, scale):
    h = torch.tanh(x * 2)
    on_host = h.cpu() * scale
    return h.sum(0) + on_host.to(x.device).mean(0)


def _host_result_alone(x, scale):
    on_host = torch.tanh(x * 2).cpu() * scale
    return on_host.to(x.device).exp().sum(0) * 2


@pytest.mark.parametrize("fn", [_host_result_beside_the_input, _host_result_alone])
def test_a_bounded_graph_split_by_device_pads_what_the_host_returns(fn):
    """A compiled function whose bounded rows visit the host between two compiled pieces: the
    piece after the host op pads that op's (unpadded) result itself, and every size matches CPU
    with one program per bucket and piece -- also where that piece reads only the host op's
    result, with no marked input of its own: it takes the whole graph's bounded dimension
    (before, it compiled one program per size: 7 here)."""
    compiled = torch.compile(fn, backend="tpu")
    torch._dynamo.reset()
    torchtpu.reset_metrics()
    scale = torch.tensor(3.0)
    for n in (3, 4, 2, 7, 5, 8, 6):  # buckets 2, 4, 8
        x = torch.randn(n, 4)
        torch.testing.assert_close(compiled(torchtpu.bounded(x, 0), scale).cpu(), fn(x, scale), msg=f"rows {n}")
    metrics = torchtpu.metrics()
    assert metrics["compiled_graphs_split"] >= 1
    assert metrics["bounded_inputs_copied"] == 4  # the host op's result, for each n not a bucket
    assert _graph_programs("inference_graph") <= 3 * 2


def test_a_split_training_step_compiles_its_backward_pieces_per_bucket_too():
    """Forward and backward of a step whose activations visit the host: every piece of both
    graphs compiles one program per bucket (the backward piece fed only by the host op's
    gradient compiled one per size before), and the loss and gradients match CPU's."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    model = copy.deepcopy(reference).to("tpu")

    def fn(m, x, scale):
        on_host = torch.tanh(m(x)).cpu() * scale
        return (on_host.to(x.device) ** 2).sum()

    compiled = torch.compile(fn, backend="tpu")
    torch._dynamo.reset()
    torchtpu.reset_metrics()
    scale = torch.tensor(3.0)
    with torch.tpu.precision("highest"):
        for n in (3, 4, 2, 7, 5, 8, 6):  # buckets 2, 4, 8
            x = torch.randn(n, 4)
            reference.zero_grad()
            model.zero_grad()
            want = fn(reference, x, scale)
            want.backward()
            got = compiled(model, torchtpu.bounded(x, 0), scale)
            got.backward()
            torch.testing.assert_close(got.cpu(), want, msg=f"loss, rows {n}")
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter.grad.cpu(), reference.get_parameter(name).grad,
                                           msg=f"{name}.grad, rows {n}")
    assert torchtpu.metrics()["compiled_graphs_split"] == 2
    for kind in ("forward_graph", "backward_graph"):
        by_piece = {name: count for name, count in torchtpu.metrics()["eager_programs_by_op"].items()
                    if name.startswith(kind)}
        assert len(by_piece) == 2 and all(count <= 3 for count in by_piece.values()), by_piece


def test_an_input_written_in_place_is_never_padded_by_copy():
    """Padding by copy would take the graph's in-place write: an unpadded input the graph writes
    raises instead, naming the input."""

    def fn(a, b):
        b.add_(a * 2)
        return a.sum(0)

    compiled = torch.compile(fn, backend="tpu")
    torch._dynamo.reset()
    x = torchtpu.bounded(torch.randn(3, 4), 0)
    y = torch.zeros(3, 4, device="tpu")
    torch._dynamo.mark_dynamic(y, 0)
    with pytest.raises(BucketingError, match="graph input 1 of shape .3, 4. has a bounded dimension and is written"):
        compiled(x, y)
    assert torch.equal(y.cpu(), torch.zeros(3, 4))
