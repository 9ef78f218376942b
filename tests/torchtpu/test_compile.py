"""`torch.compile(backend="tpu")`: AOTAutograd's forward and backward graphs compiled through the
lowering registry, matching PyTorch CPU; graph breaks and the optimizer run in the eager mode."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchtpu


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _graph_programs() -> dict[str, int]:
    by_op = torchtpu.metrics().get("eager_programs_by_op", {})
    return {name: n for name, n in by_op.items() if "_graph_" in name}


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    torchtpu.reset_metrics()
    yield
    torch._dynamo.reset()


def test_inference_matches_cpu_and_reuses_its_program():
    reference = _mlp().eval()
    model = torch.compile(copy.deepcopy(reference).to("tpu"), backend="tpu")
    with torch.tpu.precision("highest"), torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 8)
            torch.testing.assert_close(model(x.to("tpu")).cpu(), reference(x))
    programs = _graph_programs()
    assert list(programs.values()) == [1] and next(iter(programs)).startswith("inference_graph")


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_training_compiles_forward_and_backward_and_matches_cpu(mode):
    reference = _mlp()
    model = copy.deepcopy(reference).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    with torch.tpu.precision("highest"), torchtpu.eager_mode(mode):
        for step in range(4):
            x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
            losses = []
            for forward, opt, device in zip((reference, compiled), optimizers, ("cpu", "tpu")):
                opt.zero_grad()
                loss = F.cross_entropy(forward(x.to(device)), y.to(device))
                loss.backward()
                opt.step()  # outside the graph, on tpu parameters
                losses.append(loss.detach().cpu())
            torch.testing.assert_close(losses[1], losses[0], msg=f"loss at step {step}")
    for (name, p_cpu), p_tpu in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu, rtol=1e-4, atol=1e-6, msg=name)
    metrics = torchtpu.metrics()
    assert metrics["compiled_graphs"] == 2  # one forward, one backward graph
    if mode == "strict":
        assert sorted(_graph_programs().values()) == [1, 1]  # each compiled once, then reused
    else:
        assert metrics["defer_compiles"] <= 2 and metrics["defer_cache_hits"] >= 2


def test_graph_breaks_fall_back_to_the_eager_mode():
    def fn(x):
        y = (x * 2).relu()
        if y.sum() > 0:  # a data-dependent branch: Dynamo breaks the graph here
            y = y + 1
        print("eager between the graphs")
        return y.exp()

    compiled = torch.compile(fn, backend="tpu")
    x = torch.tensor([[-1.0, 0.5], [2.0, -3.0]])
    with torchtpu.eager_mode("defer"):
        out = compiled(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), fn(x))
    assert torchtpu.metrics()["compiled_graphs"] >= 2


def test_a_graph_of_host_tensors_runs_on_the_host():
    """Host code inside a compiled model (TorchRec checking a KJT kept on the host) is captured
    as a graph of its own; it runs where its tensors are, on the CPU."""

    def check(lengths, values):
        valid = (lengths >= 0).all() & (lengths.sum() == values.numel())
        return valid, values.cumsum(0) * 3

    compiled = torch.compile(check, backend="tpu")
    lengths, values = torch.tensor([2, 0, 3]), torch.arange(5)
    for _ in range(2):
        valid, sums = compiled(lengths, values)
        assert valid.device.type == "cpu" and sums.device.type == "cpu"
        torch.testing.assert_close(valid, torch.tensor(True))
        torch.testing.assert_close(sums, values.cumsum(0) * 3)
    assert torchtpu.metrics()["compiled_graphs_on_host"] == 1
    assert "compiled_graphs" not in torchtpu.metrics()


def test_a_graph_mixing_host_and_tpu_tensors_is_split_by_device():
    """Host ops beside tpu ops in one graph run on the host; the tpu ops as a compiled piece."""
    fn = lambda a, b: (a * 2 + 1, b + 1, a.sum() + b.to(a.device).sum())  # noqa: E731
    a, b = torch.randn(3), torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing lacks a lowering: no warning
        outs = torch.compile(fn, backend="tpu")(a.to("tpu"), b)
    assert [t.device.type for t in outs] == ["tpu", "cpu", "tpu"]
    torch.testing.assert_close([t.cpu() for t in outs], list(fn(a, b)))
    assert torchtpu.metrics()["compiled_graphs_split"] == 1
    assert sum(_graph_programs().values()) >= 1  # the tpu ops ran as compiled programs


def test_empty_tensors_are_made_inside_the_compiled_program():
    """`torch.empty` and its strided forms -- written by users, and by AOTAutograd for every
    `empty_like` (as `empty_permuted`, e.g. in the backward of `mish`) -- are part of the program,
    laid out as PyTorch lays them out, not eager ops that split the graph."""

    def fn(x):
        filled = torch.empty(2, 3, device=x.device).fill_(2) + x.new_empty((2, 3)).fill_(1)
        strided = torch.empty_strided((2, 3), (1, 2), device=x.device).copy_(x)
        permuted = torch.empty_like(x.t().contiguous().t()).copy_(x * 3)
        return filled + x, strided, permuted, F.mish(x) + F.hardswish(x)

    x = torch.randn(2, 3)
    x_tpu = x.to("tpu").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing lacks a lowering: no warning
        outs = torch.compile(fn, backend="tpu")(x_tpu)
        sum(out.sum() for out in outs).backward()
    x_cpu = x.clone().requires_grad_()
    expected = fn(x_cpu)
    sum(out.sum() for out in expected).backward()
    for out, reference in zip(outs, expected):
        torch.testing.assert_close(out.cpu(), reference)
        assert out.stride() == reference.stride()
    torch.testing.assert_close(x_tpu.grad.cpu(), x_cpu.grad)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_ops_eager_decomposes_outside_the_core_opset_decompose_in_graphs_too():
    """`torch.dist`, `narrow_copy`, `new_empty_strided` and `_addmm_activation` run in eager
    mode as PyTorch's decompositions, which are not Core ATen ones (`decomps._COMPILE_ALSO`); a
    compiled graph decomposes them too instead of running them eagerly beside the program. So
    does it lower the `out_dtype` products."""

    def fn(x, mm_out_dtype=True):
        bf16 = x.to(torch.bfloat16)
        return (
            torch.dist(x, x.flip(0), 3) + torch.narrow_copy(x, 1, 1, 3).sum(),
            x.new_empty_strided((2, 3), (1, 2)).fill_(1) * 2,
            torch._addmm_activation(x[0, :4], x[:, :3], x[:3, :4], use_gelu=True),
            # (CPU has no mm.dtype: its reference is the product of the widened operands.)
            torch.mm(bf16, bf16.t(), out_dtype=torch.float32) if mm_out_dtype else bf16.float() @ bf16.float().t(),
        )

    x = torch.randn(4, 5)
    with torch.tpu.precision("highest"), warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        outs = torch.compile(fn, backend="tpu")(x.to("tpu"))
    for out, reference in zip(outs, fn(x, mm_out_dtype=False)):
        torch.testing.assert_close(out.cpu(), reference, rtol=1e-5, atol=1e-5)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_outputs_are_laid_out_as_in_eager():
    """A compiled graph's new outputs get the strides PyTorch gives the eager results (a
    transposed product stays transposed), not a contiguous layout of their own."""
    fns = {
        "transposed": lambda x: (x * 2).t(),
        "permuted": lambda x: x[:, None].permute(2, 0, 1) + 0,
        "expanded then computed": lambda x: x.unsqueeze(1).expand(2, 4, 3) * 1,
        "column-major": lambda x: x.t().contiguous().t() * 2,
    }
    x = torch.randn(2, 3)
    for name, fn in fns.items():
        torch._dynamo.reset()
        out, expected = torch.compile(fn, backend="tpu")(x.to("tpu")), fn(x)
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
        assert out.stride() == expected.stride(), name


def test_dtype_casts_run_inside_the_compiled_program():
    """`x.to(dtype)` on tpu tensors (mixed precision, autocast's casts) is part of the program,
    forward and backward, not an eager op that splits the graph."""
    fn = lambda x, w: (x.to(torch.bfloat16) @ w.to(torch.bfloat16)).to(torch.float32).sum()  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    w_tpu = w.to("tpu").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing lacks a lowering: no warning
        loss = torch.compile(fn, backend="tpu")(x.to("tpu"), w_tpu)
        loss.backward()
    w_cpu = w.clone().requires_grad_()
    expected = fn(x, w_cpu)
    expected.backward()
    # One program may keep the product in float32 where eager rounds it to bfloat16 first (XLA
    # allows excess precision, as Inductor's fused kernels do): bfloat16's tolerance.
    torch.testing.assert_close(loss.cpu(), expected, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(w_tpu.grad.cpu(), w_cpu.grad, rtol=1.6e-2, atol=1e-2)
    assert w_tpu.grad.dtype == torch.float32
    assert "compiled_graphs_split" not in torchtpu.metrics()


class _HostStage(nn.Module):
    """A model that runs one stage of its forward on the host (state kept on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("host_scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        h = self.first(x).cpu()
        h = torch.tanh(h * self.host_scale.cpu())
        return self.last(h.to(x.device))


def test_training_through_a_graph_split_by_device():
    """Forward and backward graphs that cross to the host and back, against PyTorch CPU."""
    reference = _HostStage()
    model = copy.deepcopy(reference).to("tpu")
    model.host_scale = model.host_scale.cpu()
    compiled = torch.compile(model, backend="tpu")
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    with torch.tpu.precision("highest"):
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        actual = F.cross_entropy(compiled(x.to("tpu")), y.to("tpu"))
        actual.backward()
    torch.testing.assert_close(actual.detach().cpu(), expected.detach())
    for p_cpu, p_tpu in zip(reference.parameters(), model.parameters()):
        assert p_tpu.grad.device.type == "tpu"
        torch.testing.assert_close(p_tpu.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-6)
    assert torchtpu.metrics()["compiled_graphs_split"] == 2  # forward and backward


@torch.library.custom_op("torchtpu_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """An op no lowering knows: it runs as its own tpu ops, eagerly."""
    return x * factor


@_scaled.register_fake
def _(x, factor):
    return torch.empty_like(x)


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_an_op_without_a_lowering_runs_eagerly_between_compiled_pieces(mode):
    fn = lambda x: _scaled(x.sin(), 3.0).cos() + 1  # noqa: E731
    x = torch.randn(4, 3)
    with torchtpu.eager_mode(mode), pytest.warns(UserWarning, match=r"without a tpu lowering \(torchtpu_test.scaled"):
        actual = torch.compile(fn, backend="tpu")(x.to("tpu"))
        torch.testing.assert_close(actual.cpu(), fn(x))
    assert torchtpu.metrics()["compiled_graphs_split"] == 1
    if mode == "strict":
        assert len(_graph_programs()) == 2  # sin before the op, cos + 1 after it


def test_backward_inside_a_compiled_function():
    """`loss.backward()` inside the compiled function breaks the graph; the backward runs
    eagerly without Dynamo tracing torchtpu's or JAX's own Python."""
    reference = _mlp()
    model = copy.deepcopy(reference).to("tpu")

    def step(m, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss

    x, y = torch.randn(3, 8), torch.randint(0, 4, (3,))
    with torch.tpu.precision("highest"):
        expected = step(reference, x, y)
        actual = torch.compile(step, backend="tpu")(model, x.to("tpu"), y.to("tpu"))
    torch.testing.assert_close(actual.detach().cpu(), expected.detach())
    for p_cpu, p_tpu in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p_tpu.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-6)


def test_dynamic_shapes_use_each_calls_sizes():
    """A graph Dynamo made dynamic after a shape change computes sizes from each call's inputs."""
    fold = torch.compile(lambda t: t.view(t.shape[0] * 2, 2).sum(1), backend="tpu")
    for n in (4, 6, 8):
        x = torch.arange(n * 4.0).view(n, 4)
        torch.testing.assert_close(fold(x.to("tpu")).cpu(), x.view(n * 2, 2).sum(1))


def _compiled_steps_beside_cpu(optimizer, **options) -> torch.optim.Optimizer:
    """Three steps of an MLP on CPU with `optimizer(**options)` and of its tpu copy with the
    optimizer's `step` compiled; the parameters end alike. Returns the tpu model's optimizer."""
    reference = _mlp()
    model = copy.deepcopy(reference).to("tpu")
    optimizers = [optimizer(m.parameters(), **options) for m in (reference, model)]
    step = torch.compile(optimizers[1].step, backend="tpu")
    with torch.tpu.precision("highest"):
        for _ in range(3):
            x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
            for m, opt, run, device in zip((reference, model), optimizers, (optimizers[0].step, step), ("cpu", "tpu")):
                opt.zero_grad()
                F.cross_entropy(m(x.to(device)), y.to(device)).backward()
                run()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name].cpu(), value, rtol=1e-4, atol=1e-5)
    return optimizers[1]


def test_compiled_optimizer_step_writes_parameters_in_its_program():
    """A compiled `optimizer.step()` updates parameters and state inside its graph (no eager
    `copy_` per tensor), and Adam's CPU step count, which the graph also writes, still counts."""
    optimizer = _compiled_steps_beside_cpu(torch.optim.Adam, lr=1e-2)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["step"].device.type == "cpu" and state["step"].item() == 3
    assert "aten.copy_.default" not in torchtpu.metrics().get("eager_programs_by_op", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_multiply_adds_that_dynamo_fuses_run_in_the_program(dtype):
    """Dynamo writes `addcmul_` / `addcdiv_` with a value and `add_` with a tensor alpha as
    Inductor's `prims.fma` (AdamW's single-tensor step holds one): lowered, so the graph is not
    split and the values are PyTorch's on CPU (in bfloat16 within the roundings of the graph's
    stored steps: it rounds `addcmul_`'s product, where eager mode's one kernel does not)."""

    def fn(x, t1, t2, alpha):
        x.addcmul_(t1, t2, value=0.3)
        x.addcdiv_(t1, t2.abs() + 1, value=-0.7)
        return x.add_(t2, alpha=alpha)

    g = torch.Generator().manual_seed(0)
    x, t1, t2 = (torch.randn(5, 7, generator=g).to(dtype) for _ in range(3))
    alpha = torch.tensor(0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        out = torch.compile(fn, backend="tpu")(*(t.to("tpu") for t in (x, t1, t2, alpha)))
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    expected = fn(x.float(), t1.float(), t2.float(), alpha).to(dtype)
    torch.testing.assert_close(out.cpu(), expected, **tolerance)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_compiled_single_tensor_adamw_step_is_one_program():
    """AdamW without foreach, compiled: its `addcmul_` becomes `prims.fma` in the graph (above)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        _compiled_steps_beside_cpu(torch.optim.AdamW, lr=1e-2, foreach=False)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_the_default_backend_says_to_compile_with_backend_tpu():
    """Inductor's code generation for "tpu" is Google's torch_tpu Pallas one: on torchtpu's
    device it failed with "No module named 'torch_tpu'". torchtpu registers Inductor code
    generation for tpu that refuses the graph naming `backend="tpu"`; Inductor on CPU tensors in
    the same process is untouched."""
    model = _mlp()
    with pytest.raises(Exception, match='InductorOnTpuError: .* compile with torch.compile\\(model, backend="tpu"\\)'):
        torch.compile(copy.deepcopy(model).to("tpu"))(torch.randn(6, 8).to("tpu"))
    x = torch.randn(6, 8)
    torch.testing.assert_close(torch.compile(model)(x), model(x))
