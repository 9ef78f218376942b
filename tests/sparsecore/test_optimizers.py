"""Optimizer specs: construction and validation, and every row update against a NumPy model written
from the optimizer's published definition (float64), on random rows.

The NumPy models here (`NUMPY_UPDATES`) are also the references of the multi-step kernel tests in
`test_numerics.py` for the optimizers FBGEMM's CPU build and torch do not offer.
"""
from __future__ import annotations

import numpy as np
import pytest

from sparsecore import optimizers as opt


def sgd_model(spec, grad, row, slots, step):
    return row - spec.learning_rate * grad, {}


def adagrad_model(spec, grad, row, slots, step):
    accumulator = slots["accumulator"] + grad**2
    return row - spec.learning_rate * grad / (np.sqrt(accumulator) + spec.epsilon), {"accumulator": accumulator}


def rowwise_adagrad_model(spec, grad, row, slots, step):
    accumulator = slots["accumulator"] + np.mean(grad**2, axis=1, keepdims=True)
    return row - spec.learning_rate * grad / (np.sqrt(accumulator) + spec.epsilon), {"accumulator": accumulator}


def adam_model(spec, grad, row, slots, step):
    """Kingma & Ba with torch's epsilon placement: lr_t = lr sqrt(1-b2^t)/(1-b1^t)."""
    m = spec.beta1 * slots["momentum"] + (1 - spec.beta1) * grad
    v = spec.beta2 * slots["velocity"] + (1 - spec.beta2) * grad**2
    step_size = spec.learning_rate * np.sqrt(1 - spec.beta2**step) / (1 - spec.beta1**step)
    return row - step_size * m / (np.sqrt(v) + spec.epsilon), {"momentum": m, "velocity": v}


def adagrad_momentum_model(spec, grad, row, slots, step):
    if spec.beta2 == 1.0:
        accumulator = slots["accumulator"] + grad**2
    else:
        accumulator = spec.beta2 * slots["accumulator"] + (1 - spec.beta2) * grad**2
    scaled = (accumulator + spec.epsilon) ** (-1.0 / spec.exponent) * grad
    momentum = spec.momentum * slots["momentum"] + scaled
    update = spec.momentum * momentum + scaled if spec.use_nesterov else momentum
    return row - spec.learning_rate * update, {"accumulator": accumulator, "momentum": momentum}


def ftrl_model(spec, grad, row, slots, step):
    """FTRL-Proximal (McMahan et al. 2013, Algorithm 1, per coordinate) with a general
    learning-rate power and beta, as TensorFlow's ApplyFtrlV2 defines it."""
    lr, power = spec.learning_rate, spec.learning_rate_power
    l1, l2 = spec.l1_regularization_strength, spec.l2_regularization_strength
    old = slots["accumulator"]
    new = old + grad**2
    if spec.multiply_linear_by_learning_rate:
        # The linear slot holds lr * (the unscaled linear term); l1 scales with it.
        linear = slots["linear"] + lr * grad - (new ** (-power) - old ** (-power)) * row
        threshold, denominator = l1 * lr, new ** (-power) + spec.beta + 2 * lr * l2
    else:
        linear = slots["linear"] + grad - (new ** (-power) - old ** (-power)) / lr * row
        threshold, denominator = l1, (new ** (-power) + spec.beta) / lr + 2 * l2
    weights = np.where(np.abs(linear) > threshold, (np.sign(linear) * threshold - linear) / denominator, 0.0)
    return weights, {"accumulator": new, "linear": linear}


def laprop_model(spec, grad, row, slots, step):
    """LaProp (Ziyin et al. 2020): Adam's momentum applied to the RMS-normalised gradient; the
    SparseCore form has no bias correction and uses sqrt(1 - b1^2) as the momentum gain."""
    nu = spec.decay_rate * slots["nu"] + (1 - spec.decay_rate) * (grad**2 + spec.epsilon)
    mu = spec.b1 * slots["mu"] + np.sqrt(1 - spec.b1**2) * grad / np.sqrt(nu)
    return row - spec.learning_rate * mu, {"mu": mu, "nu": nu}


NUMPY_UPDATES = {
    opt.SGD: sgd_model,
    opt.Adagrad: adagrad_model,
    opt.RowWiseAdagrad: rowwise_adagrad_model,
    opt.Adam: adam_model,
    opt.AdagradMomentum: adagrad_momentum_model,
    opt.FTRL: ftrl_model,
    opt.LaProp: laprop_model,
}
"""Per optimizer class: `(spec, grad, row, slots, step) -> (row, slots)` on float64 NumPy rows."""


def numpy_update(spec, grad, row, slots, step):
    """The NumPy model of `spec`, with its clipping of the accumulated row gradient."""
    if spec.clip_gradient is not None:
        grad = np.clip(grad, -spec.clip_gradient, spec.clip_gradient)
    return NUMPY_UPDATES[type(spec)](spec, grad, row, slots, step)


SPECS = [
    opt.SGD(learning_rate=0.3),
    opt.Adagrad(learning_rate=0.2, initial_accumulator_value=0.1),
    opt.RowWiseAdagrad(learning_rate=0.2, epsilon=1e-6),
    opt.Adam(learning_rate=0.05, beta1=0.8, beta2=0.95),
    opt.AdagradMomentum(learning_rate=0.1, momentum=0.7, beta2=1.0),
    opt.AdagradMomentum(learning_rate=0.1, momentum=0.7, beta2=0.9, exponent=3.0, use_nesterov=True),
    opt.FTRL(learning_rate=0.5, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1),
    opt.FTRL(learning_rate=0.5, learning_rate_power=-0.7, l1_regularization_strength=0.01, multiply_linear_by_learning_rate=True),
    opt.LaProp(learning_rate=0.01, b1=0.85, decay_rate=0.9, epsilon=1e-8),
    opt.RowWiseAdagrad(learning_rate=0.2, clip_gradient=0.3),
    opt.Adam(learning_rate=0.05, clip_gradient=0.2),
]


def _initial_slots(spec, rows, dim, rng):
    slots = {}
    for slot in spec.slots():
        shape = (rows, slot.width(dim))
        # Non-trivial but valid starting state: accumulators stay positive.
        slots[slot.name] = slot.initial_value + rng.uniform(0.0, 0.5, shape)
    return slots


@pytest.mark.parametrize("dim, padded", [(8, 8), (12, 16), (4, 8)], ids=["dim8", "dim12_in16", "dim4_in8"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: repr(s)[:60])
def test_update_rows_matches_numpy_model(spec, dim, padded):
    """The update of `dim`-wide rows padded to `padded` columns (zero rows, zero gradient, slots
    at their initial value there), told `dim`, equals the model's on the unpadded rows: a
    row-wise slot averages over the table's dim, as FBGEMM's does; the padding stays zero."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    rows = 12
    grad = rng.normal(size=(rows, dim))
    row = rng.normal(size=(rows, dim))
    slots = _initial_slots(spec, rows, dim, rng)
    step = 3.0
    hyper = {name: jnp.float32(value) for name, value in spec.hyperparameters().items()}
    hyper[opt.STEP] = jnp.float32(step)
    pad = lambda x, value=0.0: np.pad(x, ((0, 0), (0, padded - dim)), constant_values=value)  # noqa: E731
    padded_slots = {s.name: slots[s.name] if s.per_row else pad(slots[s.name], s.initial_value) for s in spec.slots()}
    got_row, got_slots = spec.update_rows(
        jnp.asarray(pad(grad), jnp.float32),
        jnp.asarray(pad(row), jnp.float32),
        {k: jnp.asarray(v, jnp.float32) for k, v in padded_slots.items()},
        hyper,
        dim=dim,
    )
    # The model runs in float64 on the float32-rounded inputs the kernel saw.
    f32 = lambda x: np.float64(np.float32(x))  # noqa: E731
    want_row, want_slots = numpy_update(spec, f32(grad), f32(row), {k: f32(v) for k, v in slots.items()}, step)
    np.testing.assert_allclose(np.asarray(got_row)[:, :dim], want_row, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got_row)[:, dim:], 0.0)
    assert set(got_slots) == {s.name for s in spec.slots()}
    for name, value in want_slots.items():
        np.testing.assert_allclose(np.asarray(got_slots[name])[:, :dim], value, rtol=2e-5, atol=2e-6)


def test_update_rows_rejects_a_dim_wider_than_the_rows():
    import jax.numpy as jnp

    spec = opt.RowWiseAdagrad()
    grad = jnp.zeros((2, 8), jnp.float32)
    hyper = {k: jnp.float32(v) for k, v in spec.hyperparameters().items()}
    with pytest.raises(ValueError, match=r"RowWiseAdagrad: dim must be in \[1, 8\].*got 9"):
        spec.update_rows(grad, grad, {"accumulator": jnp.zeros((2, 1), jnp.float32)}, hyper, dim=9)


def test_clipping_is_elementwise_on_the_accumulated_gradient():
    import jax.numpy as jnp

    spec = opt.SGD(learning_rate=1.0, clip_gradient=0.5)
    grad = jnp.asarray([[0.2, -0.9, 3.0]], jnp.float32)
    row, _ = spec.update_rows(grad, jnp.zeros_like(grad), {}, {k: jnp.float32(v) for k, v in spec.hyperparameters().items()})
    np.testing.assert_array_equal(np.asarray(row), np.float32([[-0.2, 0.5, -0.5]]))


@pytest.mark.parametrize(
    "name, cls",
    [
        ("sgd", opt.SGD),
        ("adagrad", opt.Adagrad),
        ("rowwise_adagrad", opt.RowWiseAdagrad),
        ("adam", opt.Adam),
        ("adagrad_momentum", opt.AdagradMomentum),
        ("ftrl", opt.FTRL),
        ("laprop", opt.LaProp),
    ],
)
def test_optimizer_from_name(name, cls):
    spec = opt.optimizer_from_name(name, learning_rate=0.25)
    assert type(spec) is cls and spec.learning_rate == 0.25
    assert list(spec.hyperparameters())[0] == "learning_rate"


def test_optimizer_from_name_rejects_unknown_names_and_fields():
    with pytest.raises(ValueError, match="unknown optimizer 'adamw'"):
        opt.optimizer_from_name("adamw")
    with pytest.raises(ValueError, match=r"no field\(s\) \['beta1'\]"):
        opt.optimizer_from_name("sgd", beta1=0.9)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: opt.Adam(beta1=1.0), "beta1 must be in"),
        (lambda: opt.Adagrad(epsilon=-1.0), "epsilon must be >= 0"),
        (lambda: opt.SGD(learning_rate=float("nan")), "learning_rate must be finite"),
        (lambda: opt.SGD(clip_gradient=0.0), "clip_gradient must be positive"),
        (lambda: opt.FTRL(learning_rate_power=0.5), "learning_rate_power must be <= 0"),
        (lambda: opt.FTRL(initial_accumulator_value=0.0), "initial_accumulator_value must be positive"),
        (lambda: opt.AdagradMomentum(beta2=0.0), r"beta2 must be in \(0, 1\]"),
        (lambda: opt.LaProp(epsilon=0.0), "epsilon must be positive"),
    ],
)
def test_invalid_hyperparameters_raise(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_slots_and_hyperparameters_are_declared():
    assert opt.SGD().slots() == ()
    (accumulator,) = opt.RowWiseAdagrad(initial_accumulator_value=0.5).slots()
    assert accumulator.per_row and accumulator.width(64) == 1 and accumulator.initial_value == 0.5
    assert [s.name for s in opt.Adam().slots()] == ["momentum", "velocity"]
    assert all(s.width(64) == 64 for s in opt.FTRL().slots())
    assert opt.SGD().hyperparameters() == {"learning_rate": 0.01}
    assert opt.SGD(clip_gradient=2.0).hyperparameters() == {"learning_rate": 0.01, opt.CLIP: 2.0}
    assert list(opt.FTRL().hyperparameters()) == [
        "learning_rate",
        "learning_rate_power",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "beta",
    ]
