"""Sorting, selection, scans and binary search on `tpu` against PyTorch's CPU
kernels: stability and NaN order, tie rules, dims, 0-dim/empty/non-contiguous inputs, dtype
arguments, int32 results, in-place and out= variants, and gradients."""

from __future__ import annotations

import math

import pytest
import torch

import torchtpu  # noqa: F401
from test_reduction import input_gradient, same_as_cpu, strict_ops  # noqa: F401  (the autouse fixture)

NAN, INF = math.nan, math.inf

FLOAT = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
SPECIAL = torch.tensor([[0.0, -0.0, NAN, 1.0, -INF, 1.0, NAN, INF], [3.0, -1.0, -1.0, 2.0, 0.0, -0.0, 5.0, -2.0]])
INTS = torch.tensor([[3, -1, 7, 7, 0, 2], [2, 2, -5, 9, 9, 2], [0, 0, 0, 1, -1, 1]])
STRIDED = FLOAT.t()[::2]
SCALAR = torch.tensor(1.5)
EMPTY = torch.zeros(2, 0)


def test_sort_orders_nan_last_ascending_and_first_descending_stably():
    for descending in (False, True):
        same_as_cpu(lambda x: tuple(torch.sort(x, stable=True, descending=descending)), SPECIAL)
        same_as_cpu(lambda x: tuple(torch.sort(x, dim=0, stable=True, descending=descending)), SPECIAL)


@pytest.mark.parametrize("x", [INTS, INTS > 0, INTS.to(torch.uint8), INTS.to(torch.int8), STRIDED, FLOAT.bfloat16()],
                         ids=["int64", "bool", "uint8", "int8", "strided", "bfloat16"])
def test_stable_sort_keeps_ties_in_order(x):
    same_as_cpu(lambda t: tuple(torch.sort(t, stable=True)), x)
    same_as_cpu(lambda t: tuple(torch.sort(t, dim=0, descending=True, stable=True)), x)
    same_as_cpu(lambda t: (torch.argsort(t, dim=-1, stable=True), torch.msort(t)), x)


def test_sort_extreme_integers_descending():
    info = torch.iinfo(torch.int64)
    x = torch.tensor([0, info.min, info.max, -1, info.min, 1])
    same_as_cpu(lambda t: tuple(torch.sort(t, descending=True, stable=True)), x)


def test_sort_degenerate_shapes():
    same_as_cpu(lambda t: tuple(torch.sort(t)), SCALAR)
    same_as_cpu(lambda t: tuple(torch.sort(t, 1)), EMPTY)
    same_as_cpu(lambda t: tuple(torch.topk(t, 0)), FLOAT)
    same_as_cpu(lambda t: tuple(torch.topk(t, 1)), SCALAR)


@pytest.mark.parametrize("largest", [True, False])
def test_topk(largest):
    same_as_cpu(lambda t: tuple(torch.topk(t, 3, largest=largest)), FLOAT)
    same_as_cpu(lambda t: tuple(torch.topk(t, 2, dim=0, largest=largest)), FLOAT)
    same_as_cpu(lambda t: tuple(torch.topk(t, 3, largest=largest)), SPECIAL[1:])
    same_as_cpu(lambda t: torch.topk(t, 2, largest=largest).values, SPECIAL[:1])


def test_kthvalue():
    same_as_cpu(lambda t: tuple(torch.kthvalue(t, 3)), FLOAT)
    same_as_cpu(lambda t: tuple(torch.kthvalue(t, 1, 0, keepdim=True)), FLOAT)
    same_as_cpu(lambda t: tuple(torch.kthvalue(t, 1)), SCALAR)


def test_median_family():
    odd, even = FLOAT[:, :7], FLOAT
    for x in (odd, even, STRIDED):
        same_as_cpu(lambda t: (tuple(torch.median(t, 1)), torch.median(t), tuple(torch.nanmedian(t, 0, keepdim=True))), x)
    same_as_cpu(lambda t: tuple(torch.median(t, -1)), INTS)
    same_as_cpu(lambda t: (torch.median(t), torch.nanmedian(t)), SCALAR)
    same_as_cpu(lambda t: torch.median(t), torch.zeros(0))


def test_median_propagates_nan_and_nanmedian_skips_it():
    x = torch.tensor([[1.0, NAN, 3.0, NAN, 0.5], [NAN, NAN, 2.0, NAN, NAN], [4.0, 2.0, 1.0, 3.0, NAN]])
    same_as_cpu(lambda t: (tuple(torch.median(t, 1)), tuple(torch.nanmedian(t, 1)), torch.median(t), torch.nanmedian(t)), x)
    # An all-NaN row: NaN; which NaN's index the CPU's selection returns is unspecified.
    same_as_cpu(lambda t: (torch.nanmedian(t, 0).values, torch.nanmedian(t)), torch.full((4,), NAN))


def test_mode_picks_smallest_most_frequent_value_and_its_last_index():
    x = torch.tensor([[1, 2, 2, 3, 3, 1], [5, 5, 4, 4, 0, 0], [7, 7, 7, 1, 2, 7]])
    same_as_cpu(lambda t: tuple(torch.mode(t, 1)), x)
    same_as_cpu(lambda t: tuple(torch.mode(t, 0, keepdim=True)), x)
    same_as_cpu(lambda t: tuple(torch.mode(t)), torch.tensor([1.0, 0.5, 0.5, 2.0]))
    same_as_cpu(lambda t: tuple(torch.mode(t)), SCALAR)


@pytest.mark.parametrize("x", [FLOAT, INTS, INTS > 0, STRIDED, FLOAT.bfloat16(), SCALAR],
                         ids=["float", "int64", "bool", "strided", "bfloat16", "scalar"])
def test_scans(x):
    same_as_cpu(lambda t: (torch.cumsum(t, -1), torch.cumprod(t, 0)), x)
    same_as_cpu(lambda t: (tuple(torch.cummax(t, 0)), tuple(torch.cummin(t, -1))), x)
    if x.is_floating_point():
        same_as_cpu(lambda t: torch.logcumsumexp(t, 0), x)


def test_scan_dtype_argument_and_integer_promotion():
    same_as_cpu(lambda t: (torch.cumsum(t, 1, dtype=torch.float32), torch.cumprod(t.to(torch.int8), 1)), INTS)
    same_as_cpu(lambda t: torch.cumsum(t, 0, dtype=torch.float64), FLOAT.bfloat16())


def test_cummax_cummin_ties_take_the_later_index_and_nan_sticks():
    x = torch.tensor([[1.0, 1.0, 0.0, 2.0, 2.0, NAN, 3.0, NAN], [-INF, -INF, 5.0, 5.0, 1.0, 1.0, 0.0, 0.0]])
    same_as_cpu(lambda t: (tuple(torch.cummax(t, 1)), tuple(torch.cummin(t, 1))), x)


def test_logcumsumexp_infinities():
    x = torch.tensor([-INF, -INF, 0.0, INF, 1.0, -INF])
    same_as_cpu(lambda t: torch.logcumsumexp(t, 0), x)


def test_scans_in_place_and_out():
    same_as_cpu(lambda t: t.clone().cumsum_(1), FLOAT)
    same_as_cpu(lambda t: torch.cumprod(t, 0, out=torch.empty_like(t)), FLOAT)
    same_as_cpu(lambda t: torch.cummax(t, 1, out=(torch.empty_like(t), torch.empty_like(t, dtype=torch.long))), FLOAT)
    same_as_cpu(lambda t: torch.sort(t, 0, out=(torch.empty_like(t), torch.empty_like(t, dtype=torch.long))), FLOAT)
    same_as_cpu(lambda t: torch.topk(t, 2, out=(torch.empty(5, 2, device=t.device),
                                                torch.empty(5, 2, dtype=torch.long, device=t.device))), FLOAT)


BOUNDARIES = torch.tensor([-1.0, 0.0, 0.0, 1.5, 3.0])
QUERIES = torch.tensor([[-2.0, -1.0, 0.0, 0.5], [1.5, 2.0, 3.0, 9.0]])


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_and_bucketize(right):
    same_as_cpu(lambda b, v: torch.searchsorted(b, v, right=right), BOUNDARIES, QUERIES)
    same_as_cpu(lambda b, v: torch.searchsorted(b, v, side="right" if right else "left", out_int32=True),
                BOUNDARIES, QUERIES)
    same_as_cpu(lambda b: torch.searchsorted(b, 0.0, right=right), BOUNDARIES)
    same_as_cpu(lambda v, b: torch.bucketize(v, b, right=right), QUERIES, BOUNDARIES)
    same_as_cpu(lambda v, b: torch.bucketize(v, b, out_int32=True, right=right), QUERIES.t(), BOUNDARIES)
    rows = torch.sort(torch.randn(3, 6, generator=torch.Generator().manual_seed(2)))[0]
    same_as_cpu(lambda b, v: torch.searchsorted(b, v, right=right), rows, torch.randn(3, 4))


def test_searchsorted_with_sorter_and_mixed_dtypes():
    unsorted = torch.tensor([3.0, -1.0, 1.5, 0.0])
    same_as_cpu(lambda b, v, s: torch.searchsorted(b, v, sorter=s), unsorted, QUERIES, torch.argsort(unsorted))
    same_as_cpu(lambda b, v: torch.searchsorted(b, v), torch.tensor([0, 2, 4, 6]), torch.tensor([[1, 4], [7, -3]]))


def test_searchsorted_empty_boundaries_or_values():
    for boundaries, values in ((torch.zeros(0, 0), torch.zeros(0, 0)), (torch.zeros(3, 0), torch.zeros(3, 2)),
                               (torch.zeros(0), torch.ones(3)), (BOUNDARIES, torch.zeros(2, 0))):
        same_as_cpu(torch.searchsorted, boundaries, values)


def test_quantile_of_a_0_dim_tensor():
    same_as_cpu(lambda x: (torch.quantile(x, 0.5), torch.nanquantile(x, 0.3, dim=0, keepdim=True)), SCALAR)
    same_as_cpu(lambda x: torch.quantile(x, torch.tensor([0.25, 0.75], device=x.device)), SCALAR)
    same_as_cpu(input_gradient(lambda x: torch.quantile(x, 0.5)), SCALAR)


def test_bincount():
    x = torch.tensor([1, 1, 5, 2, 0, 5, 5])
    same_as_cpu(torch.bincount, x)
    same_as_cpu(lambda t: torch.bincount(t, minlength=9), x)
    for weights in (torch.linspace(0, 1, 7), torch.arange(7), torch.linspace(0, 1, 7, dtype=torch.float64)):
        same_as_cpu(lambda t, w: torch.bincount(t, w), x, weights)
    same_as_cpu(lambda t: torch.bincount(t, minlength=3), torch.zeros(0, dtype=torch.long))


def test_bincount_rejects_bad_input_with_a_clear_error():
    with pytest.raises(RuntimeError, match="non-negative.*-3"):
        torch.bincount(torch.tensor([1, -3]).to("tpu"))
    with pytest.raises(RuntimeError, match="1-d"):
        torch.bincount(torch.ones(2, 2, dtype=torch.long).to("tpu"))


GRADIENTS = [
    pytest.param(lambda x: torch.sort(x, 1)[0], id="sort"),
    pytest.param(lambda x: torch.topk(x, 3)[0], id="topk"),
    pytest.param(lambda x: torch.kthvalue(x, 2, 0)[0], id="kthvalue"),
    pytest.param(lambda x: torch.median(x, 1)[0], id="median"),
    pytest.param(lambda x: torch.cumsum(x, 1), id="cumsum"),
    pytest.param(lambda x: torch.cumprod(x, 0), id="cumprod"),
    pytest.param(lambda x: torch.cummax(x, 1)[0], id="cummax"),
    pytest.param(lambda x: torch.logcumsumexp(x, 1), id="logcumsumexp"),
]


@pytest.mark.parametrize("fn", GRADIENTS)
def test_gradient(fn):
    same_as_cpu(input_gradient(fn), FLOAT)
