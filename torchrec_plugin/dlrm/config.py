"""Size presets of the DLRM-DCN training job: the MLPerf DLRM-v2 structure, scaled.

Every preset keeps MLPerf DLRM-v2's shape -- 13 dense features, 26 sparse features with their
multi-hot sizes, a dense arch ending at the embedding dimension, DCN cross layers over the
interaction, an over arch ending in one logit -- and scales the tables (rows capped), the multi-hot
sizes, the widths and the batch, so that `tiny` trains in seconds (tests), `small` (the default)
in a few minutes on two cores, and `mlperf` is the configuration the throughput benchmark measures.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = [
    "MLPERF_MULTI_HOT_SIZES", "MLPERF_NUM_EMBEDDINGS", "PRESETS", "TABLE_OPTIMIZERS", "DLRMConfig", "preset",
]

NUM_DENSE_FEATURES = 13
TABLE_OPTIMIZERS = ("adagrad", "rowwise_adagrad")

MLPERF_NUM_EMBEDDINGS = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
    2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
)
"""Rows of MLPerf DLRM-v2's 26 tables (Criteo 1TB, hashed to at most 40M)."""

MLPERF_MULTI_HOT_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
"""Ids per sample of MLPerf DLRM-v2's 26 sparse features (214 in all)."""


@dataclass(frozen=True)
class DLRMConfig:
    """One training configuration: model shape, batch and optimizer.

    `num_embeddings` / `multi_hot_sizes`: rows and ids per sample of each sparse feature's table
    (one table per feature). `batch_size` is per process; `default_steps` is the length of a run.
    Tables and dense layers both train with Adagrad (the tables' fused in the backward), at their
    own learning rates: every weight's first Adagrad step has the size of the rate, which wide
    dense layers tolerate only when it is small. `table_optimizer`: "adagrad" (one accumulator
    per weight, FBGEMM's EXACT_ADAGRAD) or "rowwise_adagrad" (one per row, EXACT_ROWWISE_ADAGRAD).
    """

    name: str
    num_embeddings: tuple[int, ...]
    multi_hot_sizes: tuple[int, ...]
    embedding_dim: int
    dense_arch_layer_sizes: tuple[int, ...]
    over_arch_layer_sizes: tuple[int, ...]
    dcn_num_layers: int
    dcn_low_rank_dim: int
    batch_size: int
    default_steps: int
    embedding_learning_rate: float = 0.05
    dense_learning_rate: float = 0.05
    epsilon: float = 1e-8
    table_optimizer: str = "adagrad"

    def __post_init__(self) -> None:
        if len(self.num_embeddings) != len(self.multi_hot_sizes):
            raise ValueError(
                f"{self.name}: {len(self.num_embeddings)} tables but {len(self.multi_hot_sizes)} multi-hot sizes"
            )
        small = {f"cat_{i}": (rows, hot) for i, (rows, hot) in
                 enumerate(zip(self.num_embeddings, self.multi_hot_sizes)) if rows < 1 or hot < 1}
        if small:
            raise ValueError(f"{self.name}: every table needs rows and ids per sample >= 1, got {small}")
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"{self.name}: the dense arch must end at the embedding dimension {self.embedding_dim} "
                f"(DLRM interacts them), got {self.dense_arch_layer_sizes}"
            )
        if self.over_arch_layer_sizes[-1] != 1:
            raise ValueError(f"{self.name}: the over arch must end in one logit, got {self.over_arch_layer_sizes}")
        if self.table_optimizer not in TABLE_OPTIMIZERS:
            raise ValueError(f"{self.name}: table_optimizer must be one of {TABLE_OPTIMIZERS}, "
                             f"got {self.table_optimizer!r}")
        if self.batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be positive, got {self.batch_size}")

    @property
    def num_sparse_features(self) -> int:
        return len(self.num_embeddings)

    @property
    def num_dense_features(self) -> int:
        return NUM_DENSE_FEATURES

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The KJT keys, TorchRec's Criteo names (`cat_0` ... `cat_25`)."""
        return tuple(f"cat_{i}" for i in range(self.num_sparse_features))

    def with_batch_size(self, batch_size: int) -> DLRMConfig:
        return dataclasses.replace(self, batch_size=batch_size)

    def with_table_optimizer(self, table_optimizer: str) -> DLRMConfig:
        return dataclasses.replace(self, table_optimizer=table_optimizer)


def _scaled(name: str, max_rows: int, hot_scale: float, **shape) -> DLRMConfig:
    return DLRMConfig(
        name=name,
        num_embeddings=tuple(min(rows, max_rows) for rows in MLPERF_NUM_EMBEDDINGS),
        multi_hot_sizes=tuple(max(1, math.ceil(hot * hot_scale)) for hot in MLPERF_MULTI_HOT_SIZES),
        **shape,
    )


PRESETS: dict[str, DLRMConfig] = {
    "tiny": _scaled(
        "tiny", max_rows=200, hot_scale=0.05, embedding_dim=8, dense_arch_layer_sizes=(32, 8),
        over_arch_layer_sizes=(32, 1), dcn_num_layers=2, dcn_low_rank_dim=8, batch_size=128, default_steps=300,
    ),
    "small": _scaled(
        "small", max_rows=20_000, hot_scale=0.25, embedding_dim=32, dense_arch_layer_sizes=(128, 32),
        over_arch_layer_sizes=(256, 128, 1), dcn_num_layers=3, dcn_low_rank_dim=32, batch_size=256,
        default_steps=1000, dense_learning_rate=0.005,
    ),
    "mlperf": _scaled(
        "mlperf", max_rows=100_000, hot_scale=1.0, embedding_dim=64, dense_arch_layer_sizes=(256, 64),
        over_arch_layer_sizes=(512, 256, 1), dcn_num_layers=3, dcn_low_rank_dim=64, batch_size=1024,
        default_steps=200, dense_learning_rate=0.005,
    ),
}
"""`tiny`: tests (seconds). `small`: the default run (minutes on two cores). `mlperf`: MLPerf
DLRM-v2's tables capped at 100k rows (921k in all) with its full multi-hot sizes, dim 64 -- the
configuration `benchmarks/dlrm_throughput.py` measures against TorchRec."""


def preset(name: str) -> DLRMConfig:
    """The preset called `name`."""
    if name not in PRESETS:
        raise ValueError(f"unknown size preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
