"""Histograms (`histc`, `histogram`, `histogramdd`) on `tpu` against PyTorch's CPU kernels:
bin counts and ranges (given, data-derived, degenerate, empty input), bin-edge tensors (also
non-increasing ones, which ATen accepts), weights, density, dtypes, and the errors CPU raises."""

from __future__ import annotations

import math

import pytest
import torch

import torchtpu  # noqa: F401
from test_reduction import same_as_cpu, strict_ops  # noqa: F401  (the autouse fixture)

NAN = math.nan


def test_histc():
    data = torch.randn(500, generator=torch.Generator().manual_seed(3))
    same_as_cpu(lambda t: torch.histc(t, 10), data)
    same_as_cpu(lambda t: torch.histc(t, 7, min=-1, max=1), data)  # values outside are dropped
    same_as_cpu(lambda t: torch.histc(t, 4, min=0, max=3), torch.tensor([0.0, 1.0, 3.0, 3.0, 2.9999, NAN]))
    same_as_cpu(lambda t: torch.histc(t, 5), torch.full((6,), 2.0))  # degenerate range widens
    same_as_cpu(lambda t: torch.histc(t, 6, -2, 2), data.bfloat16())


def _like(x: torch.Tensor, values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=x.dtype, device=x.device)


HISTOGRAMS = {
    "bins": lambda x: torch.histogram(x, 7),
    "range": lambda x: torch.histogram(x, 5, range=(-1.0, 1.0)),  # values outside are dropped
    "degenerate_range": lambda x: torch.histogram(torch.ones_like(x), 4),  # widened by 0.5
    "empty": lambda x: torch.histogram(x[:0], 4),  # edges over [0, 1]
    "edges": lambda x: torch.histogram(x.reshape(10, 50), _like(x, [-2.0, -0.5, 0.0, 1.5, 3.0])),
    "weighted_density": lambda x: torch.histogram(x, 6, range=(-2.0, 2.0), weight=x.abs(), density=True),
    "edges_density": lambda x: torch.histogram(x, _like(x, [-3.0, 0.0, 0.5, 3.0]), density=True),
}


@pytest.mark.parametrize("name", HISTOGRAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histogram(name, dtype):
    data = torch.randn(500, generator=torch.Generator().manual_seed(4), dtype=dtype)
    fn = HISTOGRAMS[name]
    same_as_cpu(lambda x: tuple(fn(x)), data)


def test_histogram_rejects_what_cpu_rejects():
    data = torch.randn(8)
    bad = [lambda x: torch.histogram(x, 0), lambda x: torch.histogram(x, 3, range=(2.0, 1.0)),
           lambda x: torch.histogram(x.long(), 3), lambda x: torch.histogram(x, x.double()),
           lambda x: torch.histogram(x, 3, weight=x[:4])]
    for fn in bad:
        with pytest.raises(Exception) as on_cpu:
            fn(data)
        with pytest.raises(on_cpu.type):
            fn(data.to("tpu"))
    with pytest.raises(RuntimeError, match="not finite"):  # a data range, checked on the device
        torch.histogram(torch.tensor([0.0, math.inf]).to("tpu"), 4)[0].cpu()


def test_histogram_with_edges_that_do_not_increase():
    """ATen bins a value by std::upper_bound's bisection over the edges as given; on edges that
    are not increasing other binary searches find other bins."""
    edges = torch.tensor([0.0, -0.9, -0.5, 1.5, 0.7])
    same_as_cpu(lambda x, e: tuple(torch.histogram(x, e)), torch.linspace(-1.0, 1.0, 41), edges)


def _points(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=dtype)


HISTOGRAMDDS = {
    "bins": lambda x: torch.histogramdd(x, [2, 3, 4]),
    "one_count": lambda x: torch.histogramdd(x, 3),
    "range": lambda x: torch.histogramdd(x, [2, 3, 4], range=[-1.0, 1.0, -2.0, 0.5, 0.0, 0.0]),
    "weighted_density": lambda x: torch.histogramdd(x, [3, 2, 2], weight=x[..., 0].abs(), density=True),
    "edges": lambda x: torch.histogramdd(x, [_like(x, [-1.0, 0.0, 1.0]), _like(x, [-2.0, 2.0]),
                                             _like(x, [-1.0, -0.5, 0.0, 3.0])], density=True),
    "unsorted_edges": lambda x: torch.histogramdd(x, [_like(x, [0.0, -0.9, -0.5, 1.5, 0.7]), _like(x, [-2.0, 2.0]),
                                                      _like(x, [1.0, -1.0, 0.5])]),
    "batched_points": lambda x: torch.histogramdd(x.reshape(4, 10, 3), [2, 2, 3], weight=x[:, 0].reshape(4, 10)),
    "empty": lambda x: torch.histogramdd(x[:0], [2, 3, 1]),
    "degenerate_range": lambda x: torch.histogramdd(torch.ones_like(x), [2, 2, 2]),
}


@pytest.mark.parametrize("name", HISTOGRAMDDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histogramdd(name, dtype):
    fn = HISTOGRAMDDS[name]
    same_as_cpu(lambda x: (fn(x).hist, *fn(x).bin_edges), _points(40, 3, dtype=dtype))


def test_histogramdd_rejects_what_cpu_rejects():
    points = _points(6, 2)
    bad = [lambda x: torch.histogramdd(x, [0, 2]), lambda x: torch.histogramdd(x, [2, 2], range=[0.0, 1.0]),
           lambda x: torch.histogramdd(x, [2, 2], range=[1.0, 0.0, 0.0, 1.0]),
           lambda x: torch.histogramdd(x.long(), [2, 2]), lambda x: torch.histogramdd(x, [2, 2], weight=x),
           lambda x: torch.histogramdd(x, [_like(x, [0.0, 1.0]), _like(x, [0.0, 1.0]).double()]),
           lambda x: torch.histogramdd(x[0], [2, 2])]
    for fn in bad:
        with pytest.raises(Exception) as on_cpu:
            fn(points)
        with pytest.raises(on_cpu.type):
            fn(points.to("tpu"))
    with pytest.raises(RuntimeError, match="not finite"):  # a data range, checked on the device
        torch.histogramdd(torch.tensor([[0.0, 1.0], [math.inf, 0.0]]).to("tpu"), [2, 2]).hist.cpu()
