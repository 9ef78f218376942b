"""`_foreach_*` ops on `tpu` against PyTorch's CPU implementation: every overload kind (Scalar,
ScalarList, List, Tensor), in-place forms writing into every tensor of the list, lists of mixed
shapes and dtypes, the per-tensor reductions (`_foreach_norm`, `_foreach_max`), one program per
call, torch.optim foreach steps equal to CPU steps, and `clip_grad_norm_` compiled."""

from __future__ import annotations

import pytest
import torch

import torchtpu

BF16_TOLERANCE = dict(rtol=1.6e-2, atol=1e-2)


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g) + 2, torch.randn((), generator=g),
            torch.randn(2, 2, generator=g).to(torch.bfloat16)]  # fmt: skip


SELF, OTHER, THIRD = _tensors(0), _tensors(1), _tensors(2)
SCALARS = [0.5, -2.0, 3.0, 0.25]


def _moved(tensors):
    return [t.to("tpu") for t in tensors]


def _assert_lists_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        tolerance = BF16_TOLERANCE if e.dtype == torch.bfloat16 else {}
        torch.testing.assert_close(a.cpu(), e, equal_nan=True, **tolerance)


CALLS = {
    "add_scalar": lambda s, o, t: torch._foreach_add(s, 1.5),
    "add_list_alpha": lambda s, o, t: torch._foreach_add(s, o, alpha=-0.5),
    "add_scalarlist": lambda s, o, t: torch._foreach_add(s, SCALARS),
    "add_tensor": lambda s, o, t: torch._foreach_add(s, o[2], alpha=2),
    "sub_list": lambda s, o, t: torch._foreach_sub(s, o),
    "mul_tensor": lambda s, o, t: torch._foreach_mul(s, o[2]),
    "div_scalarlist": lambda s, o, t: torch._foreach_div(s, SCALARS),
    "maximum_scalar": lambda s, o, t: torch._foreach_maximum(s, 0.1),
    "minimum_list": lambda s, o, t: torch._foreach_minimum(s, o),
    "clamp_min_scalarlist": lambda s, o, t: torch._foreach_clamp_min(s, SCALARS),
    "clamp_max_list": lambda s, o, t: torch._foreach_clamp_max(s, o),
    "addcmul_scalar": lambda s, o, t: torch._foreach_addcmul(s, o, t, value=0.3),
    "addcdiv_scalarlist": lambda s, o, t: torch._foreach_addcdiv(s, o, torch._foreach_abs(t), SCALARS),
    "lerp_list": lambda s, o, t: torch._foreach_lerp(s, o, torch._foreach_sigmoid(t)),
    "lerp_scalar": lambda s, o, t: torch._foreach_lerp(s, o, 0.75),
    "pow_scalar": lambda s, o, t: torch._foreach_pow(s, 2.0),
    "pow_list": lambda s, o, t: torch._foreach_pow(torch._foreach_abs(s), o),
    "pow_scalar_and_tensor": lambda s, o, t: torch._foreach_pow(2.0, s),
    "sqrt": lambda s, o, t: torch._foreach_sqrt(torch._foreach_abs(s)),
    "exp_neg_sign": lambda s, o, t: torch._foreach_exp(torch._foreach_neg(torch._foreach_sign(s))),
    "log1p_reciprocal": lambda s, o, t: torch._foreach_log1p(torch._foreach_reciprocal(torch._foreach_abs(s))),
    "rounding": lambda s, o, t: torch._foreach_round(torch._foreach_mul(s, 3.0)),
    "norm": lambda s, o, t: torch._foreach_norm(s),
    "norm_orders": lambda s, o, t: [n for order in (1, 0, 3.5, float("inf"), -float("inf"))
                                    for n in torch._foreach_norm(s, order)],
    "norm_float64": lambda s, o, t: torch._foreach_norm(s[:3], 2, dtype=torch.float64),
    "max": lambda s, o, t: torch._foreach_max(s),
    "mm": lambda s, o, t: torch._foreach_mm([s[0], o[0].t()], [o[0].t(), s[0]]),
}


@pytest.mark.parametrize("name", CALLS)
def test_functional_overloads(name):
    call = CALLS[name]
    with torch.tpu.precision("highest"):  # `mm`'s products as CPU's float32
        _assert_lists_close(call(_moved(SELF), _moved(OTHER), _moved(THIRD)), call(SELF, OTHER, THIRD))


INPLACE = {
    "add_": lambda s, o: torch._foreach_add_(s, o, alpha=0.5),
    "mul_": lambda s, o: torch._foreach_mul_(s, SCALARS),
    "addcdiv_": lambda s, o: torch._foreach_addcdiv_(s, o, torch._foreach_add(torch._foreach_abs(o), 1), 0.1),
    "lerp_": lambda s, o: torch._foreach_lerp_(s, o, 0.2),
    "zero_": lambda s, o: torch._foreach_zero_(s),
    "copy_": lambda s, o: torch._foreach_copy_(s, o),
}


@pytest.mark.parametrize("name", INPLACE)
def test_inplace_writes_every_tensor(name):
    expected = [t.clone() for t in SELF]
    INPLACE[name](expected, OTHER)
    actual = _moved(SELF)
    INPLACE[name](actual, _moved(OTHER))
    _assert_lists_close(actual, expected)


def test_inplace_into_views_of_one_base():
    # Disjoint views (a row, and a strided column slice) of one storage: both writes land.
    # Overlapping views in one call are not supported: every position reads the values the list
    # had before the call, where PyTorch's CPU loop would read the earlier positions' writes.
    base = torch.arange(12.0).reshape(3, 4)
    expected = base.clone()
    torch._foreach_mul_([expected[0], expected[1:, 1]], 10.0)
    on_tpu = base.to("tpu")
    torch._foreach_mul_([on_tpu[0], on_tpu[1:, 1]], 10.0)
    torch.testing.assert_close(on_tpu.cpu(), expected)


@pytest.mark.parametrize("op", [torch._foreach_addcdiv, torch._foreach_addcmul, torch._foreach_addcdiv_])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_tensor_scalars_in_a_cpu_tensor(op, dtype):
    """The `scalars` of `_foreach_addcdiv.Tensor` may be a 1-D CPU tensor, as on CPU and CUDA."""
    scalars = torch.tensor(SCALARS, dtype=dtype)
    denominators = torch._foreach_add(torch._foreach_abs(THIRD), 1)
    expected = [t.clone() for t in SELF]
    actual = _moved(SELF)
    result = op(expected, OTHER, denominators, scalars)
    moved = op(actual, _moved(OTHER), _moved(denominators), scalars)
    _assert_lists_close(actual if moved is None else moved, expected if result is None else result)


def test_one_program_per_call_and_none_for_new_scalars():
    params = _moved(SELF)
    torch._foreach_add_(params, SCALARS)
    torchtpu.reset_metrics()
    torch._foreach_add_(params, [s * 2 for s in SCALARS])
    assert torchtpu.metrics().get("eager_programs", 0) == 0
    torch._foreach_lerp_(params, params, 0.5)
    assert torchtpu.metrics()["eager_programs"] == 1


def test_clip_grad_norm_compiled_runs_in_one_graph_and_matches_cpu():
    """`clip_grad_norm_` (its `_foreach_norm`, `_foreach_mul_`) inside `torch.compile`: one
    graph, nothing run eagerly, the same norm and clipped gradients as on CPU."""
    shapes = [(4, 3), (7,), (2, 2, 2)]
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(s, generator=g) for s in shapes]

    def clipped(device, compile_: bool):
        params = [torch.nn.Parameter(v.to(device)) for v in values]
        for p in params:
            p.grad = p.detach() * 3
        clip = lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.5, foreach=True)  # noqa: E731
        norm = (torch.compile(clip, backend="tpu") if compile_ else clip)(params)
        return [norm.cpu()] + [p.grad.cpu() for p in params]

    torch._dynamo.reset()
    torchtpu.reset_metrics()
    _assert_lists_close(clipped("tpu", True), clipped("cpu", False))
    assert torchtpu.metrics()["compiled_graphs"] == 1 and "compiled_graphs_split" not in torchtpu.metrics()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
        lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True, foreach=True),
        lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=True),
    ],
    ids=["sgd_momentum", "adam", "adamw_amsgrad", "adagrad"],
)
def test_foreach_optimizer_steps_match_cpu(make):
    shapes = [(4, 3), (7,), (2, 2, 2)]
    g = torch.Generator().manual_seed(3)
    initial = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def train(device):
        params = [torch.nn.Parameter(p.clone().to(device)) for p in initial]
        optimizer = make(params)
        for step_grads in grads:
            for p, grad in zip(params, step_grads):
                p.grad = grad.to(device)
            optimizer.step()
        return [p.detach().cpu() for p in params]

    _assert_lists_close(train("tpu"), train("cpu"))
