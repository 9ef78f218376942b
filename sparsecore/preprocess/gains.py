"""Combiner gains, computed on the host exactly as SparseCore preprocessing does.

The combiner is folded into per-id gains so the device only computes weighted sums:
gain = w / 1 (sum), w / sum(w) (mean) or w / sqrt(sum(w^2)) (sqrtn); without weights w = 1.
The arithmetic is float32 in input order, bit for bit like jax-tpu-embedding 0.2.0: sum(w) is a
float32 running sum; sum(w^2) adds double(w)^2 into a float32 accumulator (each step rounded to
float32), then takes a float32 square root. Sequence features take their weights as gains (one id
per output row, nothing to pool).
"""

from __future__ import annotations

import numpy as np

from sparsecore.spec import Combiner

__all__ = ["combiner_gains"]


def _running_sum_of_squares(weights: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per sample, float32(acc + double(w)^2) for each id in order: one vectorised step per
    position, over the samples that are that long (samples sorted by length, longest first)."""
    starts = np.cumsum(lengths) - lengths
    by_length = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[by_length]
    sorted_starts = starts[by_length]
    squares = weights.astype(np.float64) ** 2
    positions = np.arange(int(sorted_lengths[0]) if len(lengths) else 0)
    active_counts = np.searchsorted(-sorted_lengths, -positions, side="left")
    acc = np.zeros(len(lengths), dtype=np.float32)
    for position, active in zip(positions.tolist(), active_counts.tolist()):
        step = acc[:active].astype(np.float64) + squares[sorted_starts[:active] + position]
        acc[:active] = step.astype(np.float32)
    out = np.empty_like(acc)
    out[by_length] = acc
    return out


def _check_divisor(
    feature: str, combiner: Combiner, divisor: np.ndarray, lengths: np.ndarray
) -> None:
    bad = np.flatnonzero((divisor == 0) & (lengths > 0))
    if len(bad):
        what = "sum of weights" if combiner is Combiner.MEAN else "sum of squared weights"
        raise ValueError(
            f"feature {feature!r}: sample {int(bad[0])} has {int(lengths[bad[0]])} id(s) whose "
            f"{what} is 0, so its {combiner.value} combiner is undefined"
        )


def combiner_gains(
    feature: str,
    combiner: Combiner,
    lengths: np.ndarray,
    weights: np.ndarray | None,
    pooled: bool = True,
) -> np.ndarray | None:
    """Float32 gain of every id (None means all gains are 1).

    `lengths` are ids per sample (int64), `weights` float32 per id or None. A sample whose
    divisor is 0 (weights summing to 0 under mean, all-zero weights under sqrtn) is an error.
    """
    if not pooled or combiner is Combiner.SUM:
        return weights
    if weights is None:
        counts = lengths.astype(np.float32)
        with np.errstate(divide="ignore"):
            if combiner is Combiner.MEAN:
                per_sample = np.float32(1.0) / counts
            else:
                per_sample = np.float32(1.0) / np.sqrt(counts)
        return np.repeat(per_sample, lengths)
    if combiner is Combiner.MEAN:
        sample_of_id = np.repeat(np.arange(len(lengths)), lengths)
        divisor = np.zeros(len(lengths), dtype=np.float32)
        np.add.at(divisor, sample_of_id, weights)
    else:
        divisor = np.sqrt(_running_sum_of_squares(weights, lengths))
    _check_divisor(feature, combiner, divisor, lengths)
    return weights / np.repeat(divisor, lengths)
