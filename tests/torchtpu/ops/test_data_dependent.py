"""Data-dependent ops (`torchtpu/ops/data_dependent.py`) on `tpu`, against PyTorch's CPU kernels:
nonzero and its static form, masked_select, unique in all its forms, repeat_interleave with tensor
repeats -- in strict, debug and defer eager modes, each with exactly one device-to-host read."""

from __future__ import annotations

import math

import pytest
import torch

import torchtpu
from torchtpu.exec import memory

from cpu_reference import same_as_cpu, strict_ops  # noqa: F401

NAN = math.nan

X = torch.tensor([[0.0, 1.5, 0.0], [-2.0, 0.0, NAN]])

CASES = {
    "nonzero": (torch.nonzero, X),
    "nonzero_as_tuple": (lambda x: torch.nonzero(x, as_tuple=True), X),
    "nonzero_0d": (torch.nonzero, torch.tensor(3)),
    "nonzero_0d_zero": (torch.nonzero, torch.tensor(0.0)),
    "nonzero_empty": (torch.nonzero, torch.zeros(0, 3)),
    "nonzero_bool_noncontiguous": (lambda x: torch.nonzero(x.t() > 0), X),
    "argwhere": (torch.argwhere, X),
    "where_one_argument": (lambda x: torch.where(x != 0), X),
    "nonzero_static_pads": (lambda x: torch.nonzero_static(x, size=6, fill_value=-7), X),
    "nonzero_static_truncates": (lambda x: torch.nonzero_static(x, size=1), X),
    "nonzero_static_empty": (lambda x: torch.nonzero_static(x, size=2), torch.zeros(2, 0)),
    "nonzero_static_0d": (lambda x: torch.nonzero_static(x, size=3), torch.tensor(1.0)),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), X),
    "masked_select_broadcast_mask": (lambda x: torch.masked_select(x, torch.tensor([True, False, True]).to(x.device)), X),
    "masked_select_broadcast_self": (lambda x: torch.masked_select(x[0], (X > -1).to(x.device)), X),
    "masked_select_0d": (lambda x: torch.masked_select(x[0, 1], x[0, 1] > 0), X),
    "masked_select_none": (lambda x: torch.masked_select(x, x > 100), X),
    "masked_select_bf16": (lambda x: torch.masked_select(x.bfloat16(), x < 1), X),
}


@pytest.mark.parametrize("name", CASES)
def test_case(name):
    fn, x = CASES[name]
    same_as_cpu(fn, x)


def test_masked_select_refuses_a_non_bool_mask():
    x = X.to("tpu")
    with pytest.raises(RuntimeError, match="expected BoolTensor for mask, got torch.int64"):
        torch.masked_select(x, torch.ones(3, dtype=torch.int64).to("tpu"))


VALUES = torch.tensor([3.0, 1.0, 2.0, 1.0, NAN, NAN, -0.0, 0.0, 2.0])
ROWS = torch.tensor([[1, 2, 0], [1, 2, 0], [0, 5, 1], [1, 1, 9], [0, 5, 1]])


@pytest.mark.parametrize("sorted", [True, False])
@pytest.mark.parametrize("return_inverse", [True, False])
@pytest.mark.parametrize("return_counts", [True, False])
def test_unique(sorted, return_inverse, return_counts):
    flags = dict(sorted=sorted, return_inverse=return_inverse, return_counts=return_counts)
    same_as_cpu(lambda x: torch.unique(x, **flags), VALUES)  # NaNs stay distinct, -0.0 == 0.0
    same_as_cpu(lambda x: torch.unique(x, **flags), ROWS)
    same_as_cpu(lambda x: torch.unique(x, dim=0, **flags), ROWS)
    same_as_cpu(lambda x: torch.unique(x, dim=1, **flags), ROWS.t().contiguous())


@pytest.mark.parametrize("return_inverse", [True, False])
@pytest.mark.parametrize("return_counts", [True, False])
def test_unique_consecutive(return_inverse, return_counts):
    flags = dict(return_inverse=return_inverse, return_counts=return_counts)
    same_as_cpu(lambda x: torch.unique_consecutive(x, **flags), VALUES)
    same_as_cpu(lambda x: torch.unique_consecutive(x, **flags), torch.tensor([[1, 1], [2, 2], [2, 1]]))
    same_as_cpu(lambda x: torch.unique_consecutive(x, dim=0, **flags), ROWS)


@pytest.mark.parametrize(
    "x, dim",
    [(torch.tensor(5), None), (torch.zeros(0, 2), None), (torch.zeros(3, 0, 2), 1), (X > 0, None), (X > 0, 1)],
)
def test_unique_edges(x, dim):
    same_as_cpu(lambda t: torch.unique(t, dim=dim, return_inverse=True, return_counts=True), x)


def test_unique_dim_over_an_empty_other_dim_raises_as_pytorch():
    with pytest.raises(RuntimeError, match="0 sized dimensions, and they aren't selected"):
        torch.unique(torch.zeros(3, 0, 2).to("tpu"), dim=0)


REPEATS = torch.tensor([1, 0, 3, 2])


def test_repeat_interleave():
    same_as_cpu(torch.repeat_interleave, REPEATS)
    same_as_cpu(torch.repeat_interleave, REPEATS.to(torch.int32))
    same_as_cpu(torch.repeat_interleave, torch.zeros(0, dtype=torch.int64))
    same_as_cpu(lambda r: torch.repeat_interleave(r, output_size=6), REPEATS)
    same_as_cpu(lambda x, r: torch.repeat_interleave(x, r, dim=1), torch.randn(2, 4), REPEATS)
    same_as_cpu(lambda x: torch.repeat_interleave(x, 2, dim=0), torch.randn(2, 4))


def test_repeat_interleave_refuses_negative_repeats():
    with pytest.raises(RuntimeError, match="repeats can not be negative, got -2"):
        torch.repeat_interleave(torch.tensor([1, -2, 3]).to("tpu"))


@pytest.mark.parametrize("mode", torchtpu.exec.modes.MODES)
def test_one_host_read_per_op_in_every_mode(mode, monkeypatch):
    reads = []
    original = memory.to_numpy
    monkeypatch.setattr(memory, "to_numpy", lambda t: reads.append(t.shape) or original(t))
    x = X.to("tpu")
    with torchtpu.eager_mode(mode):
        for fn in (torch.nonzero, lambda t: torch.masked_select(t, t > 0), torch.unique):
            reads.clear()
            result = fn(x)
            assert len(reads) == 1, f"{fn}: {len(reads)} host reads"
            torch.testing.assert_close(result.cpu(), fn(X), equal_nan=True)
