"""Histograms: `histc`, `histogram` and `histogramdd`'s ops, with ATen's CPU semantics.

A histogram over N dimensions counts (or sums the weights of) points, the rows of the input seen
as (M, N), in bins between per-dimension edges: bin edges come as tensors, or as counts of equal
bins over a range (given, or the data's per-dimension [min, max], [0, 1] for no points; a
degenerate range is widened by 0.5 on each side) laid out by `linspace` in the input dtype.
A bin holds [left, right) except the last, [left, right]; points outside the edges (and NaN)
are not counted. A point's bin is found by the bisection of C++'s `std::upper_bound`, which
ATen's CPU kernel runs: on increasing edges that is any binary search, and ATen accepts edges
that are not increasing, where only that bisection gives its bins. `density` divides the counts
by their sum, then by each dimension's bin widths (ATen's order).

The output shapes depend only on the bin counts, so everything is static. A data-derived range
that is not finite is a device-side check (CPU raises at once; here the next synchronisation).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops import registry
from torchtpu.ops.creation import linspace_values

aten = torch.ops.aten


@registry.register(aten.histc.default)
def histc(ctx, x, bins=100, min=0, max=0):
    """Counts of `x` in `bins` equal bins over [min, max] (the data's range when min == max).

    As ATen's CPU kernel: the bin of a value is `trunc((x - min) * bins / (max - min))` computed
    in the input dtype, `max` itself falls in the last bin, and values outside [min, max] (and
    NaN) are not counted. A degenerate range is widened by 1 on each side. A data-derived range
    that is not finite cannot raise here as it does on CPU (that needs a host sync): nothing is
    counted then.
    """
    x = x.reshape(-1)
    if min == max and x.size:
        low, high = jnp.min(x), jnp.max(x)
    else:
        low, high = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    widen = low == high
    low, high = jnp.where(widen, low - 1, low), jnp.where(widen, high + 1, high)
    counted = (x >= low) & (x <= high) & jnp.isfinite(low) & jnp.isfinite(high)
    position = ((x - low) * bins / (high - low)).astype(np.int64)
    position = jnp.where(counted, jnp.minimum(position, bins - 1), bins)
    return jnp.zeros(bins, x.dtype).at[position].add(jnp.ones_like(x), mode="drop")


def _upper_bound(edges, x):
    """For each value of `x`, the index of the first edge greater than it, found as C++'s
    `std::upper_bound` bisects (the same result as any binary search on increasing edges)."""
    n = edges.shape[0]
    first = jnp.zeros(x.shape, np.int64)
    length = jnp.full(x.shape, n, np.int64)
    for _ in range(n.bit_length()):
        half = length // 2
        middle = first + half
        right = (length > 0) & ~(x < edges[jnp.minimum(middle, n - 1)])
        first = jnp.where(right, middle + 1, first)
        length = jnp.where(right, length - half - 1, half)
    return first


def _histogram(points, edges: Sequence, weight, density: bool):
    """The histogram of `points` (M, N) over the bins between `edges` (N 1-D arrays)."""
    shape = tuple(e.shape[0] - 1 for e in edges)
    index = jnp.zeros(points.shape[0], np.int64)
    counted = jnp.ones(points.shape[0], bool)
    for d, e in enumerate(edges):
        x = points[:, d]
        counted = counted & (x >= e[0]) & (x <= e[-1])
        index = index * shape[d] + jnp.minimum(_upper_bound(e, x) - 1, shape[d] - 1)
    total = math.prod(shape)
    index = jnp.where(counted, index, total)
    weight = jnp.ones(points.shape[0], points.dtype) if weight is None else weight.reshape(-1)
    hist = jnp.zeros(total, points.dtype).at[index].add(weight, mode="drop").reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            hist = hist / jnp.diff(e).reshape((1,) * d + (-1,) + (1,) * (len(edges) - d - 1))
    return hist


def _equal_bin_edges(ctx, points, bins: Sequence[int], range: Sequence[float] | None) -> list:
    """Per dimension, `bins[d] + 1` edges of equal bins over the range (see the module doc)."""
    edges = []
    for d, count in enumerate(bins):
        if range is not None:
            low, high = (jnp.asarray(v, np.float64) for v in range[2 * d:2 * d + 2])
        elif points.shape[0]:
            low, high = jnp.min(points[:, d]).astype(np.float64), jnp.max(points[:, d]).astype(np.float64)
            ctx.check(jnp.isfinite(low) & jnp.isfinite(high),
                      f"dimension {d}'s range of the input is not finite (it holds inf or NaN)")
        else:
            low, high = jnp.asarray(0.0, np.float64), jnp.asarray(1.0, np.float64)
        widen = low == high
        low, high = jnp.where(widen, low - 0.5, low), jnp.where(widen, high + 0.5, high)
        edges.append(linspace_values(low, high, count + 1, points.dtype))
    return edges


@registry.register(aten.histogram.bin_ct)
def histogram(ctx, x, bins=100, *, range=None, weight=None, density=False):
    points = x.reshape(-1, 1)
    (edges,) = _equal_bin_edges(ctx, points, (bins,), range)
    return _histogram(points, (edges,), weight, density), edges


@registry.register(aten.histogram.bins_tensor)
def histogram_bins_tensor(ctx, x, bins, *, weight=None, density=False):
    return _histogram(x.reshape(-1, 1), (bins,), weight, density), bins


def _points(x):
    return x.reshape(-1, x.shape[-1])


@registry.register(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(ctx, x, bins, *, range=None, weight=None, density=False):
    return tuple(_equal_bin_edges(ctx, _points(x), bins, range))


@registry.register(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(ctx, x, bins, *, range=None, weight=None, density=False):
    points = _points(x)
    return _histogram(points, _equal_bin_edges(ctx, points, bins, range), weight, density)


@registry.register(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(ctx, x, bins, *, weight=None, density=False):
    return _histogram(_points(x), bins, weight, density)
