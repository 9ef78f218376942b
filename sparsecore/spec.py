"""Frozen specifications of embedding tables and the features that look them up.

`TableSpec` is one logical table (vocabulary x dim) with its combiner, optimizer, initializer and
the SparseCore buffer limits; `FeatureSpec` is one input feature reading one table. Both validate
at construction, so a bad name or size fails where it is written, not deep inside a step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import jax

    from sparsecore.optimizers import OptimizerSpec

__all__ = [
    "Combiner",
    "Initializer",
    "NamedInitializer",
    "TableSpec",
    "FeatureSpec",
    "DEFAULT_MAX_IDS_PER_PARTITION",
    "DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION",
    "optimizer_key",
]

DEFAULT_MAX_IDS_PER_PARTITION = 256
DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION = 256

Initializer = Callable[["jax.Array", tuple[int, ...], Any], "jax.Array"]
"""`(key, shape, dtype) -> jax.Array`, the `jax.nn.initializers` signature."""


class Combiner(str, enum.Enum):
    """How one sample's rows are pooled: weighted sum, weighted mean, or sum / sqrt(sum w^2)."""

    SUM = "sum"
    MEAN = "mean"
    SQRTN = "sqrtn"

    @classmethod
    def parse(cls, value: Combiner | str) -> Combiner:
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown combiner {value!r}; expected one of {[c.value for c in cls]}"
            ) from None


_NAMED_INITIALIZER = re.compile(r"^\s*(zeros|uniform|normal)\s*(?:\(([^()]*)\))?\s*$")
_INITIALIZER_ARITY = {"zeros": (0,), "uniform": (2,), "normal": (1,)}


@dataclass(frozen=True)
class NamedInitializer:
    """An initializer written as text: "zeros", "uniform(a, b)" or "normal(std)" (mean 0).

    Callable like a `jax.nn.initializers` function; compares by value, so two specs written
    with the same text are equal (unlike two lambdas).
    """

    kind: str
    params: tuple[float, ...] = ()

    @classmethod
    def parse(cls, text: str) -> NamedInitializer:
        match = _NAMED_INITIALIZER.match(text)
        if match is None:
            raise ValueError(
                f"unknown initializer {text!r}; expected 'zeros', 'uniform(a, b)' or 'normal(std)'"
            )
        kind, args = match.group(1), match.group(2)
        params = tuple(float(a) for a in args.split(",")) if args and args.strip() else ()
        if len(params) not in _INITIALIZER_ARITY[kind]:
            arity = _INITIALIZER_ARITY[kind][0]
            raise ValueError(f"initializer {text!r}: {kind} takes {arity} argument(s)")
        if kind == "uniform" and not params[0] < params[1]:
            raise ValueError(f"initializer {text!r}: uniform(a, b) needs a < b")
        if kind == "normal" and not params[0] > 0:
            raise ValueError(f"initializer {text!r}: normal(std) needs std > 0")
        return cls(kind, params)

    def __call__(self, key: jax.Array, shape: tuple[int, ...], dtype: Any = None) -> jax.Array:
        import jax
        import jax.numpy as jnp

        dtype = jnp.float32 if dtype is None else dtype
        if self.kind == "zeros":
            return jnp.zeros(shape, dtype)
        if self.kind == "uniform":
            low, high = self.params
            return jax.random.uniform(key, shape, dtype, minval=low, maxval=high)
        (std,) = self.params
        return std * jax.random.normal(key, shape, dtype)

    def __str__(self) -> str:
        return self.kind if not self.params else f"{self.kind}({', '.join(map(repr, self.params))})"


def optimizer_key(optimizer: OptimizerSpec) -> tuple[str, str]:
    """A hashable key that is equal exactly when two optimizer specs are configured alike.

    Stacking may only merge tables whose optimizers match (one update runs over the whole
    stack); the key is the class and the dataclass repr, i.e. the name and every hyper-parameter.
    """
    return (type(optimizer).__qualname__, repr(optimizer))


def _default_optimizer() -> OptimizerSpec:
    from sparsecore.optimizers import SGD

    return SGD()


def _resolve_optimizer(owner: str, optimizer: OptimizerSpec | str) -> OptimizerSpec:
    from sparsecore.optimizers import OptimizerSpec, optimizer_from_name

    if isinstance(optimizer, str):
        return optimizer_from_name(optimizer)
    if not isinstance(optimizer, OptimizerSpec):
        raise ValueError(
            f"{owner}: optimizer must be an OptimizerSpec or a name, got {optimizer!r}"
        )
    return optimizer


def _require_positive(owner: str, **values: int | None) -> None:
    for field, value in values.items():
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {field} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class TableSpec:
    """One logical embedding table.

    `combiner` is a `Combiner` or its name; `optimizer` an `OptimizerSpec` from
    `sparsecore.optimizers` or a name that `optimizer_from_name` knows (default `SGD()`).
    `initializer` is a
    `(key, shape, dtype)` callable or a `NamedInitializer` text; the default is TorchRec's
    `uniform(-sqrt(1/V), sqrt(1/V))`. The limits bound the ids one SparseCore sends to one
    partition (MOD shard) per step, before (`max_ids_per_partition`) and after
    (`max_unique_ids_per_partition`) de-duplication; they fix the static buffer sizes, which
    `suggested_coo_buffer_size_per_device` may override.
    """

    name: str
    vocabulary_size: int
    embedding_dim: int
    combiner: Combiner | str = Combiner.SUM
    optimizer: OptimizerSpec | str = dataclasses.field(default_factory=_default_optimizer)
    initializer: Initializer | str | None = None
    max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION
    max_unique_ids_per_partition: int = DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION
    suggested_coo_buffer_size_per_device: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec name must be a non-empty string, got {self.name!r}")
        owner = f"TableSpec {self.name!r}"
        _require_positive(
            owner,
            vocabulary_size=self.vocabulary_size,
            embedding_dim=self.embedding_dim,
            max_ids_per_partition=self.max_ids_per_partition,
            max_unique_ids_per_partition=self.max_unique_ids_per_partition,
            suggested_coo_buffer_size_per_device=self.suggested_coo_buffer_size_per_device,
        )
        object.__setattr__(self, "combiner", Combiner.parse(self.combiner))
        object.__setattr__(self, "optimizer", _resolve_optimizer(owner, self.optimizer))
        initializer = self.initializer
        if initializer is None:
            bound = math.sqrt(1.0 / self.vocabulary_size)
            initializer = NamedInitializer("uniform", (-bound, bound))
        elif isinstance(initializer, str):
            initializer = NamedInitializer.parse(initializer)
        elif not callable(initializer):
            raise ValueError(
                f"{owner}: initializer must be callable or a name, got {initializer!r}"
            )
        object.__setattr__(self, "initializer", initializer)

    def with_limits(
        self,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        suggested_coo_buffer_size_per_device: int | None = None,
    ) -> TableSpec:
        """A copy with new limits (None keeps a limit as it is)."""
        changes: dict[str, int] = {}
        if max_ids_per_partition is not None:
            changes["max_ids_per_partition"] = max_ids_per_partition
        if max_unique_ids_per_partition is not None:
            changes["max_unique_ids_per_partition"] = max_unique_ids_per_partition
        if suggested_coo_buffer_size_per_device is not None:
            changes["suggested_coo_buffer_size_per_device"] = suggested_coo_buffer_size_per_device
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class FeatureSpec:
    """One input feature: which table it reads and how many samples a step carries.

    `batch_size` is the GLOBAL batch (all hosts together); each host feeds
    `batch_size * local_devices / global_devices` samples. A pooled feature yields one row per
    sample. A sequence (unpooled) feature sets `max_sequence_length` M: sample b's id at position
    j becomes its own output row b*M + j, so a step yields `batch_size * M` rows; samples longer
    than M are rejected, not cut.
    """

    name: str
    table: TableSpec
    batch_size: int
    max_sequence_length: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FeatureSpec name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.table, TableSpec):
            raise ValueError(
                f"FeatureSpec {self.name!r}: table must be a TableSpec, got {self.table!r}"
            )
        _require_positive(
            f"FeatureSpec {self.name!r}",
            batch_size=self.batch_size,
            max_sequence_length=self.max_sequence_length,
        )

    @property
    def is_sequence(self) -> bool:
        return self.max_sequence_length is not None

    @property
    def num_rows(self) -> int:
        """Output rows per global step: the batch, times M for a sequence feature."""
        return self.batch_size * (self.max_sequence_length or 1)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Shape of this feature's activations: [batch, dim] or [batch, M, dim]."""
        if self.is_sequence:
            return (self.batch_size, self.max_sequence_length, self.table.embedding_dim)
        return (self.batch_size, self.table.embedding_dim)
