"""Segment reductions (`torch.segment_reduce` and its backward) on `tpu` against PyTorch's CPU
kernels: lengths and offsets, every reduction, `initial`, `unsafe` lengths that cover part of the
axis, offsets that start past 0, empty segments, inner axes, NaN, ties and zeros in the
gradients, and the errors CPU raises."""

from __future__ import annotations

import math

import pytest
import torch

import torchtpu  # noqa: F401
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401  (the autouse fixture)

REDUCTIONS = ("sum", "mean", "max", "min", "prod", "amax")


def _data() -> torch.Tensor:
    """(10, 3) values with a NaN, zeros (prod's gradient) and a tie (max/min's gradient)."""
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[2, 1] = math.nan
    x[5, 0] = x[6, 2] = x[7, 2] = 0.0
    x[3, 2] = x[4, 2] = 4.0
    return x


SEGMENTS = {
    "lengths": dict(lengths=torch.tensor([2, 0, 3, 4, 1])),
    "offsets_from_1": dict(offsets=torch.tensor([1, 3, 3, 6, 9])),
    "unsafe_partial": dict(lengths=torch.tensor([2, 0, 3, 2]), unsafe=True),
}


@pytest.mark.parametrize("segments", SEGMENTS)
@pytest.mark.parametrize("initial", [None, 0.5])
@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_segment_reduce(reduce, initial, segments):
    kwargs = SEGMENTS[segments]
    bounds = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    flags = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}

    def fn(x, *tensors):
        given = dict(zip(bounds, tensors))
        return torch.segment_reduce(x, reduce, **given, **flags, initial=initial)

    same_as_cpu(fn, _data(), *bounds.values(), exact=False)
    grads_same_as_cpu(fn, _data(), *bounds.values())


@pytest.mark.parametrize("reduce", ["mean", "max", "prod"])
def test_segment_reduce_along_an_inner_axis(reduce):
    x = torch.randn(4, 6, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lengths = torch.tensor([[1, 2, 3], [0, 0, 6], [6, 0, 0], [2, 2, 2]])
    fn = lambda v, l: torch.segment_reduce(v, reduce, lengths=l, axis=-2)  # noqa: E731
    same_as_cpu(fn, x, lengths, exact=False)
    grads_same_as_cpu(fn, x, lengths)
    offsets = torch.cat([torch.zeros(4, 1, dtype=torch.long), lengths.cumsum(1)], 1).int()
    same_as_cpu(lambda v, o: torch.segment_reduce(v, reduce, offsets=o, axis=1), x.float(), offsets, exact=False)


def test_segment_reduce_rejects_what_cpu_rejects():
    x = _data()
    bad = [lambda v, l: torch.segment_reduce(v, "median", lengths=l),
           lambda v, l: torch.segment_reduce(v, "sum", lengths=l, axis=1),
           lambda v, l: torch.segment_reduce(v, "sum", lengths=l.float()),
           lambda v, l: torch.segment_reduce(v.long(), "sum", lengths=l),
           lambda v, l: torch.segment_reduce(v, "sum")]
    lengths = torch.tensor([4, 6])
    for fn in bad:
        with pytest.raises(Exception) as on_cpu:
            fn(x, lengths)
        with pytest.raises(on_cpu.type):
            fn(x.to("tpu"), lengths.to("tpu"))
    # Segment bounds are values: checked on the device, raised at the next synchronisation.
    for kwargs, message in ((dict(lengths=torch.tensor([4, 5])), "sum to"), (dict(lengths=torch.tensor([11, -1])), "negative"),
                            (dict(offsets=torch.tensor([0, 6, 3])), "non-decreasing")):
        with pytest.raises(RuntimeError):
            torch.segment_reduce(x, "sum", **kwargs)
        moved = {k: v.to("tpu") for k, v in kwargs.items()}
        with pytest.raises(RuntimeError, match=message):
            torch.segment_reduce(x.to("tpu"), "sum", **moved).cpu()
    # Unsafe lengths reaching past the data: ATen's CPU kernel reads beyond its buffer; tpu raises.
    with pytest.raises(RuntimeError, match="more than 10"):
        torch.segment_reduce(x.to("tpu"), "sum", lengths=torch.tensor([6, 6]).to("tpu"), unsafe=True).cpu()
