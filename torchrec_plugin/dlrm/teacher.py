"""The hidden "teacher" that labels the synthetic Criteo-like stream.

Clicks are drawn from `sigmoid(teacher logit)`, so a model can learn them and AUC measures how
well it did (the teacher's own probabilities reach `bayes_auc`, the best any model can). The
logit has what DLRM-DCN is built to capture:

* a first-order term per sparse feature: a hidden weight per id, averaged over the sample's ids;
* pairwise interactions (a factorization machine): hidden `rank`-dim factors per id, averaged per
  feature, summed over all feature pairs -- the crosses the interaction arch learns;
* a linear term in the dense features;
* a bias that sets the click rate near 25%, as in Criteo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Teacher"]


@dataclass(frozen=True)
class Teacher:
    """Per feature: `weights[f]` `[rows]` and `factors[f]` `[rows, rank]`; `dense_weights`
    `[13]` over centred dense features (`dense_mean`); `bias`."""

    weights: tuple[np.ndarray, ...]
    factors: tuple[np.ndarray, ...]
    dense_weights: np.ndarray
    dense_mean: np.ndarray
    bias: float

    @classmethod
    def random(
        cls,
        rng: np.random.Generator,
        num_embeddings: Sequence[int],
        dense_mean: np.ndarray,
        rank: int = 4,
        first_order_scale: float = 1.5,
        interaction_scale: float = 0.6,
        bias: float = -1.4,
    ) -> Teacher:
        """A teacher with normal hidden weights; the scales set how much each term matters."""
        features = len(num_embeddings)
        importance = rng.uniform(0.2, 1.0, size=features)
        importance *= first_order_scale / np.sqrt(np.sum(importance**2))
        weights = tuple(
            (rng.standard_normal(rows) * scale * np.sqrt(features)).astype(np.float32)
            for rows, scale in zip(num_embeddings, importance)
        )
        factor_scale = interaction_scale / np.sqrt(rank * np.sqrt(features * (features - 1) / 2))
        factors = tuple(
            (rng.standard_normal((rows, rank)) * factor_scale * np.sqrt(features)).astype(np.float32)
            for rows in num_embeddings
        )
        dense_weights = (rng.standard_normal(len(dense_mean)) * 0.3).astype(np.float32)
        return cls(weights, factors, dense_weights, dense_mean.astype(np.float32), float(bias))

    def logits(self, dense: np.ndarray, ids: Sequence[np.ndarray]) -> np.ndarray:
        """`[batch]` logits of samples with `dense` `[batch, 13]` features and, per sparse feature,
        `ids[f]` `[batch, hot_f]`."""
        first = np.zeros(dense.shape[0], dtype=np.float32)
        pooled_sum = 0.0
        pooled_squares = np.zeros(dense.shape[0], dtype=np.float32)
        for weights, factors, feature_ids in zip(self.weights, self.factors, ids):
            first += weights[feature_ids].mean(axis=1) / np.sqrt(len(self.weights))
            pooled = factors[feature_ids].mean(axis=1) / np.sqrt(len(self.factors))
            pooled_sum = pooled_sum + pooled
            pooled_squares += np.sum(pooled * pooled, axis=1)
        pairs = 0.5 * (np.sum(pooled_sum * pooled_sum, axis=1) - pooled_squares)
        return self.bias + first + pairs + (dense - self.dense_mean) @ self.dense_weights
