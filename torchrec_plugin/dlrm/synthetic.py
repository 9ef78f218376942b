"""A synthetic Criteo-like click stream, generated on the fly and reproducible by step.

Each sparse feature draws its sample's ids (as many as its multi-hot size) from a Zipf
distribution over its table's rows, hot rows scattered over the id space by a fixed permutation
(as hashing scatters real ones); the 13 dense features are `log(1 + exponential)`, like Criteo's
log-transformed counts; the click is drawn from a hidden `Teacher` over the same features.

Batch `step` of process `rank` comes from its own seeded generator, so any step can be made again
(resuming needs no data state) and held-out batches never overlap the training stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_plugin.dlrm.config import DLRMConfig
from torchrec_plugin.dlrm.teacher import Teacher

__all__ = ["SyntheticCriteo", "ZipfIds"]

_TEACHER, _TRAIN, _HELD_OUT, _LAYOUT = range(4)


class ZipfIds:
    """Ids in `[0, rows)` with `P(k-th most frequent) ~ k^-exponent`; which id is k-th is a fixed
    random permutation."""

    def __init__(self, rows: int, exponent: float, rng: np.random.Generator) -> None:
        mass = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
        self._cdf = np.cumsum(mass / mass.sum())
        self._cdf[-1] = 1.0
        self._ids = rng.permutation(rows).astype(np.int64)

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return self._ids[np.searchsorted(self._cdf, rng.random(shape), side="right")]


class SyntheticCriteo:
    """The synthetic stream for `config`: `train_batch(step)` and `held_out_batch(index)` give
    this process's `config.batch_size` samples as a TorchRec `Batch`."""

    def __init__(
        self, config: DLRMConfig, seed: int = 0, rank: int = 0, zipf_exponent: float = 1.05
    ) -> None:
        self.config = config
        self.seed = seed
        self.rank = rank
        layout = np.random.default_rng((seed, _LAYOUT))
        self._ids = [ZipfIds(rows, zipf_exponent, layout) for rows in config.num_embeddings]
        self._dense_scale = layout.uniform(0.5, 20.0, size=config.num_dense_features)
        dense_mean = np.log1p(self._dense_scale) - 0.3
        self.teacher = Teacher.random(np.random.default_rng((seed, _TEACHER)), config.num_embeddings, dense_mean)
        batch = config.batch_size
        self._lengths = torch.from_numpy(np.repeat(np.asarray(config.multi_hot_sizes, dtype=np.int64), batch))

    def train_batch(self, step: int) -> Batch:
        """This process's samples of training step `step`."""
        return self._batch(np.random.default_rng((self.seed, _TRAIN, self.rank, step)))

    def held_out_batch(self, index: int) -> Batch:
        """This process's samples of held-out batch `index` (never trained on)."""
        return self._batch(np.random.default_rng((self.seed, _HELD_OUT, self.rank, index)))

    def _batch(self, rng: np.random.Generator) -> Batch:
        config = self.config
        batch = config.batch_size
        ids = [zipf.sample(rng, (batch, hot)) for zipf, hot in zip(self._ids, config.multi_hot_sizes)]
        dense = np.log1p(rng.exponential(self._dense_scale, size=(batch, config.num_dense_features)))
        dense = dense.astype(np.float32)
        clicks = rng.random(batch) < _sigmoid(self.teacher.logits(dense, ids))
        return Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=_kjt(config.feature_names, ids, self._lengths),
            labels=torch.from_numpy(clicks.astype(np.int64)),
        )


def _kjt(keys: Sequence[str], ids: Sequence[np.ndarray], lengths: torch.Tensor) -> KeyedJaggedTensor:
    values = np.concatenate([feature_ids.reshape(-1) for feature_ids in ids])
    return KeyedJaggedTensor(keys=list(keys), values=torch.from_numpy(values), lengths=lengths)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
