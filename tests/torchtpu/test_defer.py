"""DeferAndFuse: ops are recorded, errors still surface at their line, values materialise where
the host needs them, and a steady loop replays one cached fused program."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchtpu
from torchtpu.exec import deferred


@pytest.fixture
def defer():
    torchtpu.reset_metrics()
    with torchtpu.eager_mode("defer"):
        yield
    torchtpu.reset_metrics()


def _flushes() -> dict:
    return torchtpu.metrics().get("defer_flush_reasons", {})


def test_mode_switches_api_context_and_environment():
    assert torchtpu.get_eager_mode() == "strict"
    with torchtpu.eager_mode("defer"):
        assert torchtpu.get_eager_mode() == "defer"
    torchtpu.set_eager_mode("defer")
    torchtpu.set_eager_mode("strict")
    with pytest.raises(ValueError, match="unknown eager mode 'fused'"):
        torchtpu.set_eager_mode("fused")
    code = "import torchtpu; print(torchtpu.get_eager_mode())"
    env = dict(os.environ, TORCHTPU_EAGER_MODE="defer", TORCHTPU_DEVICE_LOCK="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "defer"


def test_ops_are_recorded_and_run_as_one_program(defer):
    x = torch.arange(6.0).reshape(2, 3)
    t = x.to("tpu")
    y = ((t * 2 + 1).exp().sum(1) / 3).log()
    assert y.shape == (2,) and y.dtype == torch.float32  # known before anything ran
    assert deferred.pending_ops() >= 5 and "defer_flushes" not in torchtpu.metrics()
    torch.testing.assert_close(y.cpu(), ((x * 2 + 1).exp().sum(1) / 3).log())
    assert torchtpu.metrics()["defer_flushes"] == 1 and deferred.pending_ops() == 0


def test_a_copy_from_the_host_replaces_a_pending_value_that_earlier_ops_still_read(defer):
    def program(device):
        x = torch.arange(4.0, device=device)
        y = x * 2
        before = y + 1  # recorded while y is pending: reads y's old value
        y.copy_(torch.full((4,), 7.0))  # y's whole buffer replaced from the host
        return before, y + 1, y

    got, want = program("tpu"), program("cpu")
    assert "defer_flushes" not in torchtpu.metrics()  # y was replaced while still pending
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b)


def _line_of(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__]
    return frames[-1].line


def test_shape_and_dtype_errors_are_raised_at_their_line(defer):
    a, b = torch.ones(2, 3, device="tpu"), torch.ones(4, 5, device="tpu")
    pending = a + 1
    with pytest.raises(RuntimeError, match="same reduction dim, but got \\[2, 3\\] X \\[4, 5\\]") as shape_error:
        a @ b  # the bad line
    assert _line_of(shape_error.value) == "a @ b  # the bad line"
    counts = torch.zeros(2, 3, dtype=torch.int64, device="tpu")
    with pytest.raises(RuntimeError, match="output type Long|int.add") as dtype_error:
        counts.add_(a)
    assert "counts.add_(a)" in _line_of(dtype_error.value)
    assert "defer_flushes" not in torchtpu.metrics()  # raised while recording, nothing ran
    torch.testing.assert_close(pending.cpu(), torch.full((2, 3), 2.0))


@pytest.mark.parametrize("read", ["item", "tolist", "cpu", "to_cpu", "repr", "bool", "index", "save"])
def test_host_reads_materialise_pending_values(defer, read):
    x = torch.tensor([1.0, 2.0, 3.0])
    t = (x.to("tpu") * 2).sum() - 11  # 1.0
    expected = (x * 2).sum() - 11
    readers = {
        "item": lambda v: v.item(),
        "tolist": lambda v: v.tolist(),
        "cpu": lambda v: v.cpu().item(),
        "to_cpu": lambda v: v.to("cpu").item(),
        "repr": lambda v: float(repr(v).split("(")[1].split(",")[0]),
        "bool": lambda v: float(bool(v)),
        "index": lambda v: [0.0, 1.0, 2.0][v.long()],
        "save": lambda v: _saved(v).item(),
    }
    assert readers[read](t) == expected.item()
    assert sum(_flushes().values()) >= 1 and deferred.pending_ops() == 0


def _saved(t: torch.Tensor) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer).cpu()


def test_synchronize_runs_everything_pending(defer):
    t = torch.ones(3, device="tpu") * 4
    assert deferred.pending_ops() > 0
    torch.tpu.synchronize()
    assert deferred.pending_ops() == 0 and _flushes().get("synchronize") == 1
    assert torch.equal(t.cpu(), torch.full((3,), 4.0))


def test_data_dependent_ops_run_the_pending_graph_then_continue(defer):
    x = torch.tensor([[0.5, -1.0, 2.0], [-3.0, 0.0, 4.0]])
    t = x.to("tpu") * 2
    nz = torch.nonzero(t > 0)
    picked = t[t > 0] + 1  # boolean mask
    after = picked.sum() * 3  # recorded again after the data-dependent ops
    torch.testing.assert_close(nz.cpu(), torch.nonzero(x * 2 > 0))
    torch.testing.assert_close(picked.cpu(), (x * 2)[x * 2 > 0] + 1)
    torch.testing.assert_close(after.cpu(), ((x * 2)[x * 2 > 0] + 1).sum() * 3)


def test_a_pending_graph_at_its_size_cap_runs(defer, monkeypatch):
    monkeypatch.setattr(deferred, "MAX_PENDING_OPS", 4)  # below the loop detector's minimum
    t = torch.zeros(4, device="tpu")
    for i in range(40):
        t = t + i
    assert _flushes().get("size cap", 0) >= 2
    torch.testing.assert_close(t.cpu(), torch.full((4,), float(sum(range(40)))))


def test_random_ops_draw_the_same_streams_as_strict_mode():
    def draws():
        torch.tpu.manual_seed(123)
        a = torch.randn(3, 4, device="tpu")
        b = F.dropout(torch.ones(64, device="tpu"), p=0.5)
        c = torch.rand(5, device="tpu")
        return [v.cpu() for v in (a, b, c)]

    strict = draws()
    with torchtpu.eager_mode("defer"):
        deferred_draws = draws()
    for s, d in zip(strict, deferred_draws):
        assert torch.equal(s, d)


def test_steady_training_loop_compiles_nothing_after_warm_up(defer):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(reference).to("tpu")
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (reference, model)]
    per_step = []
    with torch.tpu.precision("highest"):
        for step in range(6):
            x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
            before = torchtpu.metrics().get("defer_compiles", 0)
            losses = []
            for m, opt, device in zip((reference, model), optimizers, ("cpu", "tpu")):
                opt.zero_grad()
                loss = F.cross_entropy(m(x.to(device)), y.to(device))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            per_step.append(torchtpu.metrics().get("defer_compiles", 0) - before)
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert per_step[2:] == [0, 0, 0, 0], per_step
    metrics = torchtpu.metrics()
    assert metrics["defer_cache_hits"] >= 4 and metrics["defer_compile_seconds"] > 0
    assert metrics["defer_ops_recorded"] > 6 * 10
    for p_cpu, p_tpu in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu, rtol=1e-4, atol=1e-6)


def test_recompile_log_names_the_argument_that_changed(defer, monkeypatch, capfd):
    monkeypatch.setenv("TORCHTPU_LOG_RECOMPILES", "1")
    for n in (4, 6):
        (torch.ones(n, 3, device="tpu") * 2).sum().item()
    err = capfd.readouterr().err
    assert "defer: compiling a new graph" in err and "has shape (6, 3) instead of (4, 3)" in err


@pytest.mark.parametrize("mode, counter", [("strict", "eager_programs"), ("defer", "defer_compiles")])
def test_clear_caches_drops_compiled_programs(mode, counter):
    x = torch.arange(5.0, device="tpu")
    with torchtpu.eager_mode(mode):
        def run() -> list[float]:
            return (x.exp() * 3).cpu().tolist()

        expected = run()
        torchtpu.reset_metrics()
        assert run() == expected and counter not in torchtpu.metrics()  # served from the cache
        torchtpu.clear_caches()
        assert run() == expected and torchtpu.metrics()[counter] >= 1  # compiled again
    torchtpu.reset_metrics()
