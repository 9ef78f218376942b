"""Optimizer specs for SparseCore embedding tables: slots, hyper-parameters and per-row updates.

Each spec is a frozen dataclass that declares

* its **slots** (optimizer state stored next to the table, one row per table row, either ``[D]``
  wide or ``[1]`` wide, with an initial value), and
* its **hyper-parameters** (the learning rate first), which the kernels receive as scalar *arrays*
  so that changing them never recompiles, and
* one **row update**: ``(grad, row, slots, hyper-parameters, dim) -> (row, slots)`` on the rows
  touched by a batch, ``dim`` being how many of the row's columns are the table's own (rows are
  padded to the chip's alignment; a padded column holds zero gradient). The fused gradient kernel
  (``sparsecore.kernels.grad_update``) is the one skeleton that accumulates each touched row's
  gradient and calls this body; on a TPU the same body becomes the computation that
  ``SparseDenseMatmulGradOpWithOptimizerUpdate`` applies per row.

Update rules follow the standard definitions their references use:

* ``SGD``, ``Adagrad``, ``RowWiseAdagrad``: FBGEMM's ``EXACT_SGD``, ``EXACT_ADAGRAD`` and
  ``EXACT_ROWWISE_ADAGRAD`` (epsilon added after the square root; row-wise accumulates the mean of
  the squared gradient over the table's own columns, not the padded row; no weight decay).
* ``Adam``: ``torch.optim.SparseAdam`` (lazy: only touched rows and their moments move). Its bias
  correction uses a per-table step count: ``step`` is the 1-based number of updates applied to the
  table, the same for every row, exactly as SparseAdam counts ``optimizer.step()`` calls.
* ``AdagradMomentum``, ``FTRL``, ``LaProp``: the SparseCore definitions (jax-tpu-embedding),
  written out in each class docstring.

Gradient clipping (``clip_gradient``, off by default) clips the *accumulated* gradient of each
touched row element-wise to ``[-clip_gradient, clip_gradient]`` before the update, like FBGEMM's
``gradient_clipping`` with ``max_gradient``. Its threshold is a hyper-parameter array too.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

Array = jax.Array

STEP = "step"
"""Name of the per-table update counter every row update receives (float32, 1-based)."""

CLIP = "clip_gradient"
"""Name of the clipping threshold among the hyper-parameters, present only when clipping is on."""


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One optimizer slot: a per-row state stored next to the table.

    ``per_row`` slots hold one value per table row (shape ``[rows, 1]``); the others hold one value
    per element (shape ``[rows, D]``).
    """

    name: str
    per_row: bool
    initial_value: float

    def width(self, embedding_dim: int) -> int:
        """Columns this slot occupies for a table of ``embedding_dim`` columns."""
        return 1 if self.per_row else embedding_dim


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Base of all optimizer specs: learning rate, optional clipping, slots and the row update.

    Subclasses list their hyper-parameter fields in ``HYPERPARAMETERS`` (after the learning rate)
    and implement ``slots`` and ``_update``. Fields that change the computed program (flags) are
    plain dataclass fields that are not listed, so they are compile-time constants.
    """

    NAME: ClassVar[str] = ""
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ()

    learning_rate: float = 0.01
    clip_gradient: float | None = None

    def __post_init__(self) -> None:
        for name, value in self.hyperparameters().items():
            if not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}: {name} must be finite, got {value}")
        if self.clip_gradient is not None and not self.clip_gradient > 0:
            raise ValueError(
                f"{type(self).__name__}: clip_gradient must be positive, got {self.clip_gradient}"
            )
        self._validate()

    def _validate(self) -> None:
        """Check the subclass's hyper-parameter ranges; raise ``ValueError`` naming the field."""

    def slots(self) -> tuple[SlotSpec, ...]:
        """The slots this optimizer keeps per table row, in a fixed order."""
        return ()

    def hyperparameters(self) -> dict[str, float]:
        """Current hyper-parameter values by name: learning rate first, then the subclass's,
        then the clipping threshold when clipping is on."""
        values = {"learning_rate": float(self.learning_rate)}
        values.update({name: float(getattr(self, name)) for name in self.HYPERPARAMETERS})
        if self.clip_gradient is not None:
            values[CLIP] = float(self.clip_gradient)
        return values

    def update_rows(
        self,
        grad: Array,
        rows: Array,
        slots: Mapping[str, Array],
        hyperparameters: Mapping[str, Array],
        *,
        dim: int | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """Apply one update to touched rows.

        ``grad`` and ``rows`` are ``[U, D]`` (or ``[1, D]`` for one row), each slot is ``[U, D]``
        or ``[U, 1]``; ``hyperparameters`` maps every name of ``hyperparameters()`` plus
        ``STEP`` to a float32 scalar (or an array broadcastable to a row). ``dim`` is the
        table's own width: the first ``dim`` of the D columns are the table's, the rest padding
        with zero gradient (None: all D). Returns the new rows and slots.
        """
        width = grad.shape[-1]
        dim = width if dim is None else dim
        if not 0 < dim <= width:
            raise ValueError(f"{type(self).__name__}: dim must be in [1, {width}] (the row's columns), got {dim}")
        if self.clip_gradient is not None:
            limit = hyperparameters[CLIP]
            grad = jnp.clip(grad, -limit, limit)
        return self._update(grad, rows, dict(slots), hyperparameters, dim)

    def _update(
        self,
        grad: Array,
        rows: Array,
        slots: dict[str, Array],
        hp: Mapping[str, Array],
        dim: int,
    ) -> tuple[Array, dict[str, Array]]:
        """The update rule; ``dim`` (the table's own columns of the row) matters only to a
        reduction over the row: element-wise rules never mix padding into the table's columns."""
        raise NotImplementedError(f"{type(self).__name__} defines no row update")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(OptimizerSpec):
    """``row -= lr * grad`` (FBGEMM ``EXACT_SGD``)."""

    NAME: ClassVar[str] = "sgd"

    def _update(self, grad, rows, slots, hp, dim):
        return rows - hp["learning_rate"] * grad, slots


@dataclasses.dataclass(frozen=True, kw_only=True)
class _AdagradFamily(OptimizerSpec):
    """``acc += squared(grad); row -= lr * grad / (sqrt(acc) + eps)``, with one accumulator per
    element or (`PER_ROW`) per row holding the row's mean squared gradient over the table's own
    ``dim`` columns (padded columns hold zero gradient, so the sum over the row is the table's)."""

    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("epsilon",)
    PER_ROW: ClassVar[bool] = False

    epsilon: float = 1e-8
    initial_accumulator_value: float = 0.0

    def _validate(self) -> None:
        _require_non_negative(self, "epsilon", "initial_accumulator_value")

    def slots(self) -> tuple[SlotSpec, ...]:
        return (SlotSpec("accumulator", per_row=self.PER_ROW, initial_value=self.initial_accumulator_value),)

    def _update(self, grad, rows, slots, hp, dim):
        squared = jnp.sum(grad * grad, axis=-1, keepdims=True) / dim if self.PER_ROW else grad * grad
        accumulator = slots["accumulator"] + squared
        rows = rows - hp["learning_rate"] * grad / (jnp.sqrt(accumulator) + hp["epsilon"])
        return rows, {"accumulator": accumulator}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(_AdagradFamily):
    """Element-wise Adagrad (FBGEMM ``EXACT_ADAGRAD``):
    ``acc += grad²; row -= lr * grad / (sqrt(acc) + eps)``."""

    NAME: ClassVar[str] = "adagrad"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowWiseAdagrad(_AdagradFamily):
    """Row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row,
    ``acc += mean(grad², over the table's dim); row -= lr * grad / (sqrt(acc) + eps)``."""

    NAME: ClassVar[str] = "rowwise_adagrad"
    PER_ROW: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam(OptimizerSpec):
    """Lazy Adam as ``torch.optim.SparseAdam``: only touched rows and their moments move.

    ``m += (1-β1)(g - m); v += (1-β2)(g² - v);
    row -= lr·sqrt(1-β2^t)/(1-β1^t) · m / (sqrt(v) + eps)``, with ``t`` the table's update count.
    """

    NAME: ClassVar[str] = "adam"
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("beta1", "beta2", "epsilon")

    learning_rate: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def _validate(self) -> None:
        _require_unit_interval(self, "beta1", "beta2")
        _require_non_negative(self, "epsilon")

    def slots(self) -> tuple[SlotSpec, ...]:
        return (
            SlotSpec("momentum", per_row=False, initial_value=0.0),
            SlotSpec("velocity", per_row=False, initial_value=0.0),
        )

    def _update(self, grad, rows, slots, hp, dim):
        beta1, beta2, step = hp["beta1"], hp["beta2"], hp[STEP]
        momentum = slots["momentum"] + (1 - beta1) * (grad - slots["momentum"])
        velocity = slots["velocity"] + (1 - beta2) * (grad * grad - slots["velocity"])
        step_size = hp["learning_rate"] * jnp.sqrt(1 - beta2**step) / (1 - beta1**step)
        rows = rows - step_size * momentum / (jnp.sqrt(velocity) + hp["epsilon"])
        return rows, {"momentum": momentum, "velocity": velocity}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdagradMomentum(OptimizerSpec):
    """Adagrad with momentum (the SparseCore definition).

    ``acc = acc + g²`` if β2 = 1, else ``β2·acc + (1-β2)·g²``;
    ``s = (acc + eps)^(-1/exponent) · g``; ``m = momentum·m + s``;
    ``row -= lr · (momentum·m + s if use_nesterov else m)``.
    """

    NAME: ClassVar[str] = "adagrad_momentum"
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("momentum", "beta2", "epsilon", "exponent")

    momentum: float = 0.9
    beta2: float = 1.0
    epsilon: float = 1e-10
    exponent: float = 2.0
    use_nesterov: bool = False
    initial_accumulator_value: float = 0.0

    def _validate(self) -> None:
        _require_non_negative(self, "momentum", "epsilon", "initial_accumulator_value")
        if not 0.0 < self.beta2 <= 1.0:
            raise ValueError(f"AdagradMomentum: beta2 must be in (0, 1], got {self.beta2}")
        if self.exponent == 0.0:
            raise ValueError("AdagradMomentum: exponent must be non-zero")

    def slots(self) -> tuple[SlotSpec, ...]:
        return (
            SlotSpec("accumulator", per_row=False, initial_value=self.initial_accumulator_value),
            SlotSpec("momentum", per_row=False, initial_value=0.0),
        )

    def _update(self, grad, rows, slots, hp, dim):
        beta2, momentum = hp["beta2"], hp["momentum"]
        squared = grad * grad
        accumulator = jnp.where(
            beta2 == 1.0,
            slots["accumulator"] + squared,
            beta2 * slots["accumulator"] + (1 - beta2) * squared,
        )
        scaled = (accumulator + hp["epsilon"]) ** (-1.0 / hp["exponent"]) * grad
        velocity = momentum * slots["momentum"] + scaled
        step = momentum * velocity + scaled if self.use_nesterov else velocity
        rows = rows - hp["learning_rate"] * step
        return rows, {"accumulator": accumulator, "momentum": velocity}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FTRL(OptimizerSpec):
    """FTRL-Proximal (McMahan et al.; the SparseCore and TensorFlow definition).

    ``acc' = acc + g²``; ``p = acc^(-power)``, ``p' = acc'^(-power)``;
    ``linear += g - (p' - p)/lr · row`` (or ``lr·g - (p' - p)·row`` with
    ``multiply_linear_by_learning_rate``);
    ``row = (clip(linear, -l1, l1) - linear) / ((p' + beta)/lr + 2·l2)``
    (or ``/ (p' + beta + 2·lr·l2)`` with l1 scaled by lr, when multiplying by the learning rate).
    """

    NAME: ClassVar[str] = "ftrl"
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = (
        "learning_rate_power",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "beta",
    )

    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    multiply_linear_by_learning_rate: bool = False

    def _validate(self) -> None:
        _require_non_negative(
            self, "l1_regularization_strength", "l2_regularization_strength", "beta"
        )
        if self.learning_rate_power > 0:
            raise ValueError(
                f"FTRL: learning_rate_power must be <= 0, got {self.learning_rate_power}"
            )
        if not self.initial_accumulator_value > 0:
            raise ValueError(
                "FTRL: initial_accumulator_value must be positive (its power is taken), got "
                f"{self.initial_accumulator_value}"
            )

    def slots(self) -> tuple[SlotSpec, ...]:
        return (
            SlotSpec("accumulator", per_row=False, initial_value=self.initial_accumulator_value),
            SlotSpec("linear", per_row=False, initial_value=0.0),
        )

    def _update(self, grad, rows, slots, hp, dim):
        lr, power = hp["learning_rate"], hp["learning_rate_power"]
        l1, l2, beta = hp["l1_regularization_strength"], hp["l2_regularization_strength"], hp["beta"]
        accumulator = slots["accumulator"] + grad * grad
        p_old = slots["accumulator"] ** (-power)
        p_new = accumulator ** (-power)
        if self.multiply_linear_by_learning_rate:
            linear = slots["linear"] + lr * grad - (p_new - p_old) * rows
            l1 = l1 * lr
            denominator = p_new + beta + 2 * lr * l2
        else:
            linear = slots["linear"] + grad - (p_new - p_old) / lr * rows
            denominator = (p_new + beta) / lr + 2 * l2
        rows = (jnp.clip(linear, -l1, l1) - linear) / denominator
        return rows, {"accumulator": accumulator, "linear": linear}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaProp(OptimizerSpec):
    """LaProp (Ziyin et al. 2020) as SparseCore defines it, without bias correction.

    ``nu = decay·nu + (1-decay)·(g² + eps)``; ``mu = b1·mu + sqrt(1-b1²) · g/sqrt(nu)``;
    ``row -= lr · mu``.
    """

    NAME: ClassVar[str] = "laprop"
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("b1", "decay_rate", "epsilon")

    learning_rate: float = 0.001
    b1: float = 0.9
    decay_rate: float = 0.95
    epsilon: float = 1e-30

    def _validate(self) -> None:
        _require_unit_interval(self, "b1", "decay_rate")
        if not self.epsilon > 0:
            raise ValueError(f"LaProp: epsilon must be positive, got {self.epsilon}")

    def slots(self) -> tuple[SlotSpec, ...]:
        return (
            SlotSpec("mu", per_row=False, initial_value=0.0),
            SlotSpec("nu", per_row=False, initial_value=0.0),
        )

    def _update(self, grad, rows, slots, hp, dim):
        b1, decay = hp["b1"], hp["decay_rate"]
        nu = decay * slots["nu"] + (1 - decay) * (grad * grad + hp["epsilon"])
        mu = b1 * slots["mu"] + jnp.sqrt(1 - b1 * b1) * (grad / jnp.sqrt(nu))
        return rows - hp["learning_rate"] * mu, {"mu": mu, "nu": nu}


OPTIMIZERS: dict[str, type[OptimizerSpec]] = {
    cls.NAME: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam, AdagradMomentum, FTRL, LaProp)
}
"""Optimizer spec classes by their canonical name."""


def optimizer_from_name(name: str, **hyperparameters: Any) -> OptimizerSpec:
    """Build the spec named ``name`` (e.g. ``"rowwise_adagrad"``) with the given fields.

    Raises ``ValueError`` for an unknown name or a field the optimizer does not have.
    """
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(OPTIMIZERS)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(hyperparameters) - fields)
    if unknown:
        raise ValueError(f"optimizer {name!r} has no field(s) {unknown}; it has {sorted(fields)}")
    return cls(**hyperparameters)


def _require_non_negative(spec: OptimizerSpec, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if value < 0:
            raise ValueError(f"{type(spec).__name__}: {name} must be >= 0, got {value}")


def _require_unit_interval(spec: OptimizerSpec, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{type(spec).__name__}: {name} must be in [0, 1), got {value}")
