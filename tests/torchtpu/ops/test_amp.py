"""The gradient scaler's ops on `tpu` against PyTorch's CPU kernels, bit for bit: unscaling with
the inf/NaN check (every floating dtype, views, a flag already set, an empty list), the scale's
growth and back-off (factors float32 cannot hold, growth that would overflow), the errors CPU
raises, and `torch.amp.GradScaler("tpu")` over a few steps against the same scaler on CPU."""

from __future__ import annotations

import math

import pytest
import torch

import torchtpu
from test_reduction import strict_ops  # noqa: F401  (the autouse fixture: no CPU fallback)

MODES = ["strict", "defer"]


def _gradients(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(7, 5, generator=g) * 1e4).to(dtype)
    return [big, big.t()[1:4], torch.randn(11, generator=g).to(dtype)]  # a view of a tensor in the list too


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def _unscale_on_both(grads: list[torch.Tensor], found_inf: float, inv_scale: float) -> None:
    """Unscale CPU copies of `grads` and `tpu` ones in place; both results must be equal."""
    cpu = [g.clone() for g in grads]
    tpu = [g.to("tpu") for g in grads]
    cpu_found, tpu_found = torch.full((1,), found_inf), torch.full((1,), found_inf, device="tpu")
    inv = torch.full((1,), inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(cpu, cpu_found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(tpu, tpu_found, inv.to("tpu"))
    for actual, expected in zip(tpu, cpu):
        _assert_same(actual, expected)
    _assert_same(tpu_found, cpu_found)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
def test_unscale_matches_cpu(mode, dtype, bad):
    grads = _gradients(dtype)
    if bad is not None:
        grads[2][5] = bad
    with torchtpu.eager_mode(mode):
        _unscale_on_both(grads, 0.0, 1 / 3)
        _unscale_on_both(grads, 1.0, 1 / 65536)  # a flag already set stays set
        _unscale_on_both(grads, 0.0, 1.0)


def test_unscale_of_no_gradients_leaves_the_flag():
    _unscale_on_both([], 0.0, 0.5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("growth_interval", [1, 3])
def test_update_scale_matches_cpu(mode, growth_interval):
    found = [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    cpu = torch.full((1,), 3.0e37), torch.zeros(1, dtype=torch.int32)  # grows into overflow
    tpu = tuple(t.to("tpu") for t in cpu)
    with torchtpu.eager_mode(mode):
        for step, flag in enumerate(found):
            growth, backoff = (2.0001, 0.3) if step % 2 else (4.0, 0.5)  # not all exact in float32
            for scale, tracker in (cpu, tpu):
                inf = torch.full((1,), float(flag), device=scale.device)
                assert torch._amp_update_scale_(scale, tracker, inf, growth, backoff, growth_interval) is scale
            _assert_same(tpu[0], cpu[0])
            _assert_same(tpu[1], cpu[1])


def _f32(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


REJECTED = {
    "unscale_inv_scale_float64": lambda d: torch._amp_foreach_non_finite_check_and_unscale_(
        [_f32(3).to(d)], _f32(1).to(d), _f32(1, dtype=torch.float64).to(d)),
    "unscale_found_inf_two_elements": lambda d: torch._amp_foreach_non_finite_check_and_unscale_(
        [_f32(3).to(d)], _f32(2).to(d), _f32(1).to(d)),
    "unscale_integer_gradient": lambda d: torch._amp_foreach_non_finite_check_and_unscale_(
        [_f32(3, dtype=torch.int64).to(d)], _f32(1).to(d), _f32(1).to(d)),
    "update_tracker_float": lambda d: torch._amp_update_scale_(
        _f32(1).to(d), _f32(1).to(d), _f32(1).to(d), 2.0, 0.5, 3),
    "update_scale_two_elements": lambda d: torch._amp_update_scale_(
        _f32(2).to(d), _f32(1, dtype=torch.int32).to(d), _f32(1).to(d), 2.0, 0.5, 3),
    "update_found_inf_float64": lambda d: torch._amp_update_scale_(
        _f32(1).to(d), _f32(1, dtype=torch.int32).to(d), _f32(1, dtype=torch.float64).to(d), 2.0, 0.5, 3),
}


@pytest.mark.parametrize("name", REJECTED)
def test_rejects_what_cpu_rejects(name):
    with pytest.raises((RuntimeError, NotImplementedError)) as cpu_error:
        REJECTED[name]("cpu")
    with pytest.raises(type(cpu_error.value), match=f"^{cpu_error.value}$".replace("'", ".").replace('"', ".")):
        REJECTED[name]("tpu")


@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_steps_as_on_cpu(mode):
    """Five steps of `torch.amp.GradScaler` with SGD, the third with an inf gradient (skipped,
    scale backed off) and growth every two good steps: parameters and scale as on CPU. The model
    is elementwise, so both devices compute the same gradients."""
    inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    inputs[2, 3] = math.inf
    results = {}
    for device in ("cpu", "tpu"):
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 8).to(device))
        optimizer = torch.optim.SGD([weight], lr=0.125)  # a power of two: each update rounds once
        scaler = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=2)
        scales = []
        with torchtpu.eager_mode(mode):
            for x in inputs.to(device):
                optimizer.zero_grad()
                scaler.scale((weight * x).sum()).backward()
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
        results[device] = weight.detach().cpu(), scales
    _assert_same(results["tpu"][0], results["cpu"][0])
    assert results["tpu"][1] == results["cpu"][1] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
