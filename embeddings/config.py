"""TorchRec table configs with the SparseCore limits, and their translation to `sparsecore` specs.

`SparseCoreEmbeddingConfig` wraps a TorchRec `EmbeddingBagConfig` (pooled) or `EmbeddingConfig`
(unpooled) with what a SparseCore needs on top: the per-partition id limits that fix its static
buffers, and for unpooled tables `max_seq_len`, the longest sequence a sample may carry. A plain
TorchRec config is accepted wherever a wrapped one is, with the default limits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Union

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType

from sparsecore.optimizers import OptimizerSpec
from sparsecore.spec import (
    DEFAULT_MAX_IDS_PER_PARTITION,
    DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION,
    Combiner,
    FeatureSpec,
    NamedInitializer,
    TableSpec,
)

__all__ = ["SparseCoreEmbeddingConfig", "TableConfig", "as_sparsecore_config", "embedding_names"]

TorchRecConfig = Union[EmbeddingBagConfig, EmbeddingConfig]

_COMBINERS = {PoolingType.SUM: Combiner.SUM, PoolingType.MEAN: Combiner.MEAN}


@dataclass(frozen=True)
class SparseCoreEmbeddingConfig:
    """A TorchRec table config and its SparseCore limits.

    `max_ids_per_partition` / `max_unique_ids_per_partition` bound the ids (before / after
    de-duplication) one SparseCore sends to one MOD shard of this table per step;
    `suggested_coo_buffer_size_per_device` overrides the buffer size they imply. Unpooled tables
    (`EmbeddingConfig`) need `max_seq_len`; pooled ones must not set it.
    """

    config: TorchRecConfig
    max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION
    max_unique_ids_per_partition: int = DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION
    suggested_coo_buffer_size_per_device: int | None = None
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        config = self.config
        if not isinstance(config, (EmbeddingBagConfig, EmbeddingConfig)):
            raise TypeError(
                f"SparseCoreEmbeddingConfig wraps a torchrec EmbeddingBagConfig or EmbeddingConfig, "
                f"got {type(config).__name__}"
            )
        owner = f"table {config.name!r}"
        if not config.name:
            raise ValueError("a SparseCore table needs a name (TorchRec config `name` is empty)")
        if config.data_type != DataType.FP32:
            raise ValueError(f"{owner}: SparseCore tables are float32; data_type {config.data_type} is not supported")
        if self.pooled:
            if config.pooling not in _COMBINERS:
                raise ValueError(
                    f"{owner}: pooling {config.pooling} is not supported for pooled tables; "
                    f"use {[p.name for p in _COMBINERS]}"
                )
            if self.max_seq_len is not None:
                raise ValueError(f"{owner}: max_seq_len is for unpooled tables (EmbeddingConfig) only")
        elif self.max_seq_len is None:
            raise ValueError(
                f"{owner}: an unpooled table needs max_seq_len, the most ids one sample may carry "
                "(SparseCore buffers have static shapes)"
            )

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def pooled(self) -> bool:
        return isinstance(self.config, EmbeddingBagConfig)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The KJT keys this table reads (TorchRec's default: the table's own name)."""
        return tuple(self.config.feature_names) or (self.config.name,)

    @property
    def host_initializer(self) -> Callable[[torch.Tensor], object] | None:
        """The config's `init_fn` when it cannot run on the device (anything but TorchRec's
        default uniform), else None."""
        init = self.config.init_fn
        if init is None or _uniform_bounds(init) is not None:
            return None
        return init

    def table_spec(self, optimizer: OptimizerSpec) -> TableSpec:
        """The `sparsecore` table: TorchRec's uniform bounds become the device initializer (a
        custom `init_fn` runs on the host instead, see `host_initializer`)."""
        config = self.config
        bounds = _uniform_bounds(config.init_fn) if config.init_fn is not None else None
        if bounds is None:
            bounds = (config.get_weight_init_min(), config.get_weight_init_max())
        return TableSpec(
            name=config.name,
            vocabulary_size=config.num_embeddings,
            embedding_dim=config.embedding_dim,
            combiner=_COMBINERS[config.pooling] if self.pooled else Combiner.SUM,
            optimizer=optimizer,
            initializer=NamedInitializer("uniform", bounds),
            max_ids_per_partition=self.max_ids_per_partition,
            max_unique_ids_per_partition=self.max_unique_ids_per_partition,
            suggested_coo_buffer_size_per_device=self.suggested_coo_buffer_size_per_device,
        )

    def feature_specs(self, table: TableSpec, names: tuple[str, ...], batch_size: int) -> tuple[FeatureSpec, ...]:
        """One `FeatureSpec` per feature, named by its embedding name, for a global batch."""
        return tuple(
            FeatureSpec(name, table, batch_size, max_sequence_length=self.max_seq_len) for name in names
        )


TableConfig = Union[SparseCoreEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig]


def as_sparsecore_config(config: TableConfig) -> SparseCoreEmbeddingConfig:
    """`config` itself if wrapped, else a plain TorchRec config with the default limits."""
    if isinstance(config, SparseCoreEmbeddingConfig):
        return config
    return SparseCoreEmbeddingConfig(config)


def embedding_names(configs: list[SparseCoreEmbeddingConfig]) -> list[tuple[str, ...]]:
    """Per table, the output name of each feature: the feature name, or "feature@table" when
    several tables read the feature (TorchRec's `get_embedding_names_by_table`)."""
    readers: dict[str, int] = {}
    for config in configs:
        for feature in config.feature_names:
            readers[feature] = readers.get(feature, 0) + 1
    return [
        tuple(f"{feature}@{config.name}" if readers[feature] > 1 else feature for feature in config.feature_names)
        for config in configs
    ]


def _uniform_bounds(init: Callable[..., object]) -> tuple[float, float] | None:
    """(a, b) of TorchRec's default `init_fn`, `partial(torch.nn.init.uniform_, a=..., b=...)`."""
    if isinstance(init, functools.partial) and init.func is torch.nn.init.uniform_ and not init.args:
        a, b = init.keywords.get("a", 0.0), init.keywords.get("b", 1.0)
        if math.isfinite(a) and math.isfinite(b) and a < b:
            return float(a), float(b)
    return None
