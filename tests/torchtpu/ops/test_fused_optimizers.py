"""`torch.optim.{Adam,AdamW,SGD,Adagrad}(fused=True)` on `tpu` against the same optimizers on CPU,
whose fused kernels are the reference: several steps over parameters of several shapes (one a
transposed view, one holding an inf) in float32, bfloat16 and float16 with every option of each
optimizer, a tensor lr, lr schedules (without recompiling), `torch.amp.GradScaler` with a skipped
inf step, the ops' `found_inf` and `grad_scale`, and the errors CPU raises.

XLA:CPU does not round two kinds of operations as the C++ kernels do, so float32 results differ
in the last bits and the comparisons allow a few ulps (`_ULPS`, measured):
- `a * b + c`, which the kernels compute as one fused multiply-add (`vec::fmadd`, and GCC
  contracts the rest): XLA:CPU rounds the product first at the test suite's optimisation level 0,
  and at its default level contracts every such sum, around its own choice of product where both
  addends are products (Adam's `exp_avg_sq * beta2 + (1 - beta2) * grad * grad`, SGD's
  `buffer * momentum + grad * (1 - dampening)`) and also where the kernel rounds the product
  (AdamW's `param * (1 - lr * weight_decay)` followed by `+ update`). Every optimizer has such sums.
- A division by a scalar, which XLA rewrites as a multiplication by its reciprocal (two
  roundings): Adam's `sqrt(exp_avg_sq) / bias_correction2_sqrt`, and unscaling by a `grad_scale`
  that is not a power of two (GradScaler's always is).
In bfloat16 and float16 the float32 results are rounded again; SGD and Adagrad then match bit for
bit, Adam within 1 ulp. Bit for bit everywhere: what is not a rounding (which end `lerp`
computes from, non-finite values, skipped steps, gradients, step counts, errors), and single
steps in which only the hyperparameters' double arithmetic could round otherwise.

The CPU kernels' bfloat16/float16 vector loops of SGD (which never store the parameters: pytorch
issue 191763) and Adagrad (which round lr, eps and weight_decay to the parameter's dtype) are
not what the lowering computes; their scalar loops are. Those dtypes are compared on tensors
smaller than one vector (16 elements), which the kernels run through their scalar loops, and
Adagrad's vector loop with hyperparameters that bfloat16 and float16 hold exactly.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

import torchtpu
from test_reduction import strict_ops  # noqa: F401  (the autouse fixture: no CPU fallback)

MODES = ["strict", "defer"]
REDUCED = [torch.bfloat16, torch.float16]
DTYPES = [torch.float32, *REDUCED]
STEPS = 5

SHAPES = [(37, 29), (16,), (5,), (3, 4)]
# Fewer elements than one vector of the CPU kernels' bfloat16/float16 loops.
SMALL_SHAPES = [(5,), (3, 4)]

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
              "adagrad": torch.optim.Adagrad}

# Ulps allowed (float32, bfloat16/float16), of the larger of an element's magnitude and its
# tensor's mean magnitude. Measured over these tests at XLA:CPU's default optimisation and at the
# test suite's level 0, at most: Adam(W) 3.7 and 0.9, SGD 3.4 and 0, Adagrad 1.6 and 0.
_ULPS = {"adam": (4, 1), "adamw": (4, 1), "sgd": (4, 0), "adagrad": (2, 0)}


def _ulps(name: str, dtype: torch.dtype) -> int:
    return _ULPS[name][dtype != torch.float32]


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Random parameters of `shapes`, one more that is a transposed (non-contiguous) view, and an
    inf entry (which L2 weight decay turns into NaNs, and which must stay inf without it)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=g).to(dtype) for shape in [*shapes, (3, 5)]]
    params[-1] = params[-1].t()
    params[0].view(-1)[1] = math.inf
    return params


def _grads(params: list[torch.Tensor], seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    return [[torch.randn(p.shape, generator=g).to(p.dtype) for p in params] for _ in range(STEPS)]


def _like(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` in a tensor with `t`'s device and strides, as autograd lays out a parameter's
    gradient (the CPU kernels walk every tensor of a parameter in its storage order)."""
    return torch.empty_like(t).copy_(values)


def _state(weights: list[torch.Tensor], opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Each parameter's value, gradient and optimizer state."""
    return [{"param": w.detach(), "grad": w.grad, **opt.state[w]} for w in weights]


def _train(device: str, name: str, kwargs: dict, params: list[torch.Tensor], grads: list[list[torch.Tensor]],
           mode: str, schedule: bool = False, after_step: Callable[[], None] | None = None) -> list[dict]:
    """Run the fused optimizer on `device` over `grads`, halving the lr every two steps if
    `schedule`."""
    weights = [torch.nn.Parameter(p.to(device, copy=True)) for p in params]
    # A tensor lr of each run's own: the scheduler fills it.
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    opt = OPTIMIZERS[name](weights, fused=True, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    with torchtpu.eager_mode(mode):
        for step in grads:
            for w, g in zip(weights, step):
                w.grad = _like(w, g)
            opt.step()
            if scheduler is not None:
                scheduler.step()
            if after_step is not None:
                after_step()
    return _state(weights, opt)


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 0) -> None:
    """Bit for bit if `ulps` is 0; else within `ulps` units in the last place of the larger of the
    element's magnitude and the tensor's mean magnitude (a sum rounded otherwise is off by ulps
    of its terms, which can be far larger than a result that cancels to nearly 0). Non-finite
    values must be equal."""
    actual = actual.cpu()
    if ulps == 0:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double(), expected.double()
    finite = e.isfinite()
    torch.testing.assert_close(a[~finite], e[~finite], rtol=0, atol=0, equal_nan=True)
    a, e = a[finite], e[finite]
    magnitude = torch.maximum(e.abs(), e.abs().mean())
    error = torch.where(a == e, 0, (a - e).abs() / (torch.finfo(expected.dtype).eps * magnitude))
    assert error.max() <= ulps, f"{error.max().item():.2f} ulps apart, {ulps} allowed"


def _assert_results_match(actual: list[dict], expected: list[dict], ulps: int) -> None:
    """Every parameter and state tensor alike; gradients and step counts bit for bit."""
    for got, want in zip(actual, expected):
        assert got.keys() == want.keys()
        for key in want:
            _assert_matches(got[key], want[key], 0 if key in ("grad", "step") else ulps)


def _assert_trained_alike(name: str, kwargs: dict, shapes, dtype: torch.dtype, mode: str, seed: int = 0) -> None:
    """Train on CPU and on tpu from the same values: the same results."""
    params = _params(shapes, dtype, seed)
    grads = _grads(params, seed)
    expected = _train("cpu", name, kwargs, params, grads, "strict")
    _assert_results_match(_train("tpu", name, kwargs, params, grads, mode), expected, _ulps(name, dtype))


ADAM = {
    "adam": ("adam", {"lr": 0.01}),
    "amsgrad_weight_decay": ("adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    # beta1 = 0.3: lerp's weight 0.7 is over 0.5, so the first moment is computed from the gradient's end.
    "maximize_far_lerp": ("adam", {"lr": 0.02, "betas": (0.3, 0.8), "maximize": True, "eps": 1e-6}),
    # Betas that float32 rounds to 1 (the bias corrections would be 0): the kernel's are doubles.
    "betas_near_one": ("adam", {"lr": 0.01, "betas": (1 - 1e-9, 1 - 1e-10)}),
    "adamw": ("adamw", {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_amsgrad_maximize": ("adamw", {"lr": 0.01, "weight_decay": 0.5, "amsgrad": True, "maximize": True}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ADAM)
def test_adam_matches_cpu(mode, dtype, case):
    _assert_trained_alike(*ADAM[case], SHAPES, dtype, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_adam_first_moment_from_lerps_end_as_on_cpu(mode, beta1):
    """`exp_avg.lerp_(grad, 1 - beta1)` starts from exp_avg when the weight is under 0.5, else
    from grad: `exp_avg + w * (grad - exp_avg)` or `grad - (grad - exp_avg) * (1 - w)`. A
    difference that overflows tells which: inf from exp_avg's end, -inf from grad's."""
    tensors = {}
    for device in ("cpu", "tpu"):
        param, grad, exp_avg, exp_avg_sq = (torch.tensor([1.0, 1.0], device=device) for _ in range(4))
        grad[0], exp_avg[0] = 3e38, -3e38
        with torchtpu.eager_mode(mode):
            torch._fused_adam_([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(1.0, device=device)],
                               lr=0.01, beta1=beta1, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                               maximize=False)
        tensors[device] = param, exp_avg, exp_avg_sq
    assert tensors["cpu"][1][0] == (math.inf if beta1 > 0.5 else -math.inf)
    for actual, expected in zip(tensors["tpu"], tensors["cpu"]):
        _assert_matches(actual, expected)


STEP_COUNTS = (1.0, 2.0, 3.0, 10.0, 1000.0)

# One step in which nothing but the hyperparameters' rounding can differ from CPU: zero state and
# zero parameters (beta2 = 0 makes Adam's second bias correction 1, a division XLA cannot round
# otherwise), or for AdamW, whose decay multiplies the parameters, zero gradients.
FROM_ZERO = {
    "adam": {"lr": 0.0123, "beta1": 0.9, "beta2": 0.0, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
             "maximize": False},
    "adamw": {"lr": 0.0544, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.108, "eps": 1e-8, "amsgrad": False,
              "maximize": False},
    "adagrad": {"lr": 0.0123, "lr_decay": 0.07, "weight_decay": 0.0, "eps": 1e-10, "maximize": False},
    "sgd": {"weight_decay": 0.0, "momentum": 0.9, "lr": 0.0123, "dampening": 0.33, "nesterov": False,
            "maximize": False, "is_first_step": False},
}


def _step_from_zero(device: str, name: str) -> list[torch.Tensor]:
    """One `_fused_{name}_` step of float32 tensors (`FROM_ZERO`), one parameter per count of
    `STEP_COUNTS`; returns the parameters."""
    g = torch.Generator().manual_seed(7)
    values = [torch.randn(20, generator=g).to(device) for _ in STEP_COUNTS]
    state, state2, zeros = ([torch.zeros(20, device=device) for _ in STEP_COUNTS] for _ in range(3))
    params, grads = (values, zeros) if name == "adamw" else (zeros, values)
    steps = [torch.tensor(count, device=device) for count in STEP_COUNTS]
    if name == "adagrad":
        torch._fused_adagrad_(params, grads, state, steps, **FROM_ZERO[name])
    elif name == "sgd":
        torch._fused_sgd_(params, grads, state, **FROM_ZERO[name])
    else:
        getattr(torch, f"_fused_{name}_")(params, grads, state, state2, [], steps, **FROM_ZERO[name])
    return params


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FROM_ZERO)
def test_hyperparameters_rounded_from_doubles_as_on_cpu(mode, name):
    """The kernels take the Python floats as doubles and round what they compute from them to
    float32 once: Adam's step size `lr / (1 - beta1 ** step)`, AdamW's `1 - lr * weight_decay`,
    Adagrad's decayed lr `lr / (1 + (step - 1) * lr_decay)`, SGD's `1 - dampening`. Bit for bit."""
    expected = _step_from_zero("cpu", name)
    with torchtpu.eager_mode(mode):
        actual = _step_from_zero("tpu", name)
    for got, want in zip(actual, expected):
        _assert_matches(got, want)


SGD = {
    "plain": {"lr": 0.01},
    "weight_decay_maximize": {"lr": 0.01, "weight_decay": 0.1, "maximize": True},
    "momentum_dampening": {"lr": 0.01, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.1},
    "nesterov": {"lr": 0.01, "momentum": 0.9, "nesterov": True},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SGD)
def test_sgd_matches_cpu(mode, dtype, case):
    """Momentum's first step (the buffer starts as the gradient) and later ones, dampening,
    Nesterov, no momentum (no buffers)."""
    shapes = SHAPES if dtype == torch.float32 else SMALL_SHAPES
    _assert_trained_alike("sgd", SGD[case], shapes, dtype, mode, seed=1)


ADAGRAD = {
    "plain": {"lr": 0.01},
    "lr_decay_weight_decay_maximize": {"lr": 0.01, "lr_decay": 0.05, "weight_decay": 0.1, "maximize": True,
                                       "eps": 1e-6},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ADAGRAD)
def test_adagrad_matches_cpu(mode, dtype, case):
    """The lr decayed by the step count, `lr / (1 + (step - 1) * lr_decay)`."""
    shapes = SHAPES if dtype == torch.float32 else SMALL_SHAPES
    _assert_trained_alike("adagrad", ADAGRAD[case], shapes, dtype, mode, seed=2)


@pytest.mark.parametrize("dtype", REDUCED)
def test_reduced_adagrad_on_whole_vectors_matches_cpu(dtype):
    """Large bfloat16/float16 tensors, through the CPU kernel's vector loop: with an lr, eps and
    weight decay that the dtype holds exactly, its rounding of them changes nothing."""
    kwargs = {"lr": 2.0**-6, "eps": 2.0**-20, "weight_decay": 2.0**-3}
    _assert_trained_alike("adagrad", kwargs, SHAPES, dtype, "strict", seed=3)


# Each optimizer with options that use all of its state.
WITH_STATE = {
    "adam": {"weight_decay": 0.1, "amsgrad": True},
    "adamw": {"weight_decay": 0.1},
    "sgd": {"momentum": 0.9, "weight_decay": 0.1},
    "adagrad": {"lr_decay": 0.05},
}


def _eager_programs(op: str) -> int:
    return torchtpu.metrics().get("eager_programs_by_op", {}).get(op, 0)


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float_lr", "tensor_lr"])
@pytest.mark.parametrize("name", WITH_STATE)
def test_lr_schedule_matches_cpu_without_recompiling(name, tensor_lr):
    """An lr halved every two steps by a scheduler (a float, or a tensor the scheduler fills):
    trained as on CPU, and the lr is a runtime value: no step compiles again once it changes."""
    kwargs = {**WITH_STATE[name], "lr": torch.tensor(0.01) if tensor_lr else 0.01}
    op = f"aten._fused_{name}_.{'tensor_lr' if tensor_lr else 'default'}"
    compiled = []
    params = _params([(11, 13)], torch.float32, 4)  # shapes of this test only: its programs compile here
    grads = _grads(params, 4)
    expected = _train("cpu", name, kwargs, params, grads, "strict", schedule=True)
    actual = _train("tpu", name, kwargs, params, grads, "strict", schedule=True,
                    after_step=lambda: compiled.append(_eager_programs(op)))
    _assert_results_match(actual, expected, _ulps(name, torch.float32))
    assert compiled[0] >= 1 and compiled[-1] == compiled[1]  # SGD's first step is a program of its own


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", WITH_STATE)
def test_grad_scaler_steps_as_on_cpu(mode, name):
    """`torch.amp.GradScaler` hands a fused optimizer the scale and the inf flag: it divides the
    gradients by the scale (and stores them so), and skips the step whose gradients hold an inf
    (the optimizer counts its steps back, the scale backs off). Parameters, gradients, states and
    scales as on CPU; the model is elementwise, so both devices compute the same gradients."""
    inputs = torch.randn(STEPS, 3, 8, generator=torch.Generator().manual_seed(5))
    inputs[2, 1, 3] = math.inf
    results = {}
    for device in ("cpu", "tpu"):
        weights = [torch.nn.Parameter(w.to(device)) for w in torch.linspace(-1, 1, 24).reshape(3, 8)]
        opt = OPTIMIZERS[name](weights, lr=0.01, fused=True, **WITH_STATE[name])
        scaler = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=2)
        scales = []
        with torchtpu.eager_mode(mode if device == "tpu" else "strict"):
            for x in inputs.to(device):
                opt.zero_grad()
                scaler.scale(sum((w * xi).sum() for w, xi in zip(weights, x))).backward()
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
        results[device] = _state(weights, opt), scales
    (actual, tpu_scales), (expected, cpu_scales) = results["tpu"], results["cpu"]
    assert tpu_scales == cpu_scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    _assert_results_match(actual, expected, _ulps(name, torch.float32))


def _adagrad_step(device: str, found_inf: float | None, grad_scale: float | None) -> list[torch.Tensor]:
    """One `_fused_adagrad_` step of fixed float32 tensors on `device`; returns them all."""
    g = torch.Generator().manual_seed(6)
    param, grad, state_sum = (torch.randn(40, generator=g).to(device) for _ in range(3))
    state_sum.abs_()
    step = torch.tensor(3.0, device=device)
    flags = {name: torch.full((1,), value, device=device)
             for name, value in (("found_inf", found_inf), ("grad_scale", grad_scale)) if value is not None}
    torch._fused_adagrad_([param], [grad], [state_sum], [step], lr=0.01, lr_decay=0.0, weight_decay=0.0,
                          eps=1e-10, maximize=False, **flags)
    return [param, grad, state_sum, step]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("found_inf, grad_scale", [(1.0, 4.0), (0.0, 4.0), (2.0, 0.5), (None, 8.0)])
def test_found_inf_and_grad_scale_as_on_cpu(mode, found_inf, grad_scale):
    """A `found_inf` of 1 leaves every tensor as it was (bit for bit), the gradients still
    scaled; any other value (0, or 2 from summing two devices' flags) does not: the kernel
    compares with 1. The gradients are written back divided by `grad_scale`."""
    expected = _adagrad_step("cpu", found_inf, grad_scale)
    with torchtpu.eager_mode(mode):
        actual = _adagrad_step("tpu", found_inf, grad_scale)
    for got, want, key in zip(actual, expected, ("param", "grad", "sum", "step")):
        exact = found_inf == 1 or key in ("grad", "step")
        _assert_matches(got, want, 0 if exact else _ulps("adagrad", torch.float32))


def _zeros(device: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _adam_call(device: str, *, grads: int = 1, maxima: int = 0, steps: int = 1, amsgrad: bool = False,
               lr: Any = 0.01, step_shape: tuple[int, ...] = (), grad_dtype=torch.float32, param_dtype=torch.float32,
               grad_scale: torch.dtype | None = None) -> None:
    lr = _zeros(device, *lr) if isinstance(lr, tuple) else lr
    scale = None if grad_scale is None else _zeros(device, 1, dtype=grad_scale)
    torch._fused_adam_([_zeros(device, 3, dtype=param_dtype)], [_zeros(device, 3, dtype=grad_dtype)] * grads,
                       [_zeros(device, 3, dtype=param_dtype)], [_zeros(device, 3, dtype=param_dtype)],
                       [_zeros(device, 3, dtype=param_dtype)] * maxima, [_zeros(device, *step_shape)] * steps, lr=lr,
                       beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=amsgrad, maximize=False,
                       grad_scale=scale)


def _sgd_call(device: str, *, buffers: int, momentum: float, grad_dtype=torch.float32) -> None:
    torch._fused_sgd_([_zeros(device, 3)], [_zeros(device, 3, dtype=grad_dtype)], [_zeros(device, 3)] * buffers,
                      weight_decay=0.0, momentum=momentum, lr=0.1, dampening=0.0, nesterov=False, maximize=False,
                      is_first_step=False)


def _adagrad_call(device: str, *, sums: int = 1, steps: int = 1, param_dtype=torch.float32) -> None:
    torch._fused_adagrad_([_zeros(device, 3, dtype=param_dtype)], [_zeros(device, 3, dtype=param_dtype)],
                          [_zeros(device, 3, dtype=param_dtype)] * sums, [_zeros(device)] * steps, lr=0.1,
                          lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False)


REJECTED = {
    "adam_more_grads": lambda d: _adam_call(d, grads=2),
    "adam_max_exp_avg_sqs_without_amsgrad": lambda d: _adam_call(d, maxima=1),
    "adam_no_max_exp_avg_sqs_with_amsgrad": lambda d: _adam_call(d, amsgrad=True),
    "adam_no_state_steps": lambda d: _adam_call(d, steps=0),
    "adam_two_element_step": lambda d: _adam_call(d, step_shape=(2,)),
    "adam_two_element_tensor_lr": lambda d: _adam_call(d, lr=(2,)),
    "adam_integer_params": lambda d: _adam_call(d, param_dtype=torch.int64, grad_dtype=torch.int64),
    "adam_float64_grad": lambda d: _adam_call(d, grad_dtype=torch.float64),
    "adam_float64_grad_scale": lambda d: _adam_call(d, grad_scale=torch.float64),
    "sgd_no_momentum_buffers": lambda d: _sgd_call(d, buffers=0, momentum=0.9),
    "sgd_momentum_buffers_without_momentum": lambda d: _sgd_call(d, buffers=1, momentum=0.0),
    "sgd_bfloat16_grad": lambda d: _sgd_call(d, buffers=1, momentum=0.9, grad_dtype=torch.bfloat16),
    "adagrad_no_state_sums": lambda d: _adagrad_call(d, sums=0),
    "adagrad_two_state_steps": lambda d: _adagrad_call(d, steps=2),
    "adagrad_int16_params": lambda d: _adagrad_call(d, param_dtype=torch.int16),
}


@pytest.mark.parametrize("name", REJECTED)
def test_rejects_what_cpu_rejects(name):
    with pytest.raises((RuntimeError, NotImplementedError)) as cpu_error:
        REJECTED[name]("cpu")
    with pytest.raises(type(cpu_error.value)) as tpu_error:
        REJECTED[name]("tpu")
    assert str(tpu_error.value) == str(cpu_error.value)
