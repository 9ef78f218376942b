"""Combiner gains are bit-exact float32 in input order, against the loop-per-id model."""

from __future__ import annotations

import numpy as np
import pytest

from _reference_model import sample_gains
from sparsecore.preprocess.gains import combiner_gains
from sparsecore.spec import Combiner


@pytest.mark.parametrize("combiner", list(Combiner))
@pytest.mark.parametrize("weighted", [False, True])
def test_gains_match_the_model_bit_for_bit(combiner, weighted):
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 12, 3000)
    weights = None
    if weighted:
        weights = (rng.random(lengths.sum()) * rng.choice([1e-3, 1.0, 1e3], lengths.sum())).astype(
            np.float32
        )
    gains = combiner_gains("f", combiner, lengths, weights)
    if gains is None:
        gains = np.ones(lengths.sum(), np.float32)
    expected, start = [], 0
    for n in lengths:
        w = [np.float32(1)] * n if weights is None else list(weights[start : start + n])
        expected.extend(sample_gains(combiner.value, w))
        start += n
    np.testing.assert_array_equal(
        gains.view(np.uint32), np.array(expected, np.float32).view(np.uint32)
    )


def test_sequence_features_take_their_weights_as_gains():
    weights = np.array([0.5, 3.0, 0.25], np.float32)
    assert combiner_gains("f", Combiner.MEAN, np.array([2, 1]), weights, pooled=False) is weights
    assert combiner_gains("f", Combiner.SQRTN, np.array([2, 1]), None, pooled=False) is None
