"""Reductions on `tpu` against PyTorch's CPU kernels: dims and keepdim conventions, dtype
arguments and promotion, NaN propagation, first-index ties, integer wraparound, 0-dim, empty and
non-contiguous inputs, bfloat16, out= through the executor, and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._pytree import tree_map

import torchtpu  # noqa: F401

NAN, INF = math.nan, math.inf


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    """A CPU fallback is not coverage: make it an error."""
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


def _to_tpu(x):
    return x.to("tpu") if isinstance(x, torch.Tensor) else x


def _to_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def same_as_cpu(fn, *args, **kwargs):
    """Run `fn` on CPU arguments and on `tpu` copies; the results must match (dtype included)."""
    expected = fn(*args, **kwargs)
    actual = tree_map(_to_cpu, fn(*tree_map(_to_tpu, args), **tree_map(_to_tpu, kwargs)))
    torch.testing.assert_close(actual, expected, equal_nan=True)
    return actual


def _floats() -> torch.Tensor:
    x = torch.linspace(-3, 4, 35).reshape(5, 7).sin() * 5
    x[1, 2] = NAN
    return x


FLOAT = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0))
STRIDED = FLOAT.transpose(0, 2)[:, ::2]  # non-contiguous view
INTS = torch.tensor([[3, -1, 7, 7, 0], [2, 2, -5, 9, 9], [0, 0, 0, 1, -1]])
TIES = torch.tensor([[1.0, 3.0, 3.0, -2.0], [-2.0, -2.0, 0.0, -2.0]])
SCALAR = torch.tensor(2.5)
EMPTY = torch.zeros(3, 0)

REDUCTIONS = {
    "sum_all": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(1),
    "sum_dims_keepdim": lambda x: x.sum((0, -1), keepdim=True),
    "sum_empty_dims": lambda x: torch.sum(x, []),
    "sum_dtype": lambda x: x.sum(0, dtype=torch.float64),
    "mean_all": lambda x: x.float().mean(),
    "mean_dim": lambda x: x.float().mean(-1, keepdim=True),
    "nansum": lambda x: torch.nansum(x, 0),
    "nanmean": lambda x: torch.nanmean(x.float(), 1),
    "prod_all": lambda x: x.prod(),
    "prod_dim": lambda x: x.prod(1, keepdim=True),
    "amax": lambda x: x.amax((0, 1)),
    "amin_keepdim": lambda x: x.amin(-1, keepdim=True),
    "max_all": lambda x: x.max(),
    "min_all": lambda x: x.min(),
    "max_dim": lambda x: tuple(torch.max(x, 1)),
    "min_dim_keepdim": lambda x: tuple(torch.min(x, 0, keepdim=True)),
    "argmax_all": lambda x: x.argmax(),
    "argmin_dim": lambda x: x.argmin(1),
    "argmax_keepdim": lambda x: x.argmax(0, keepdim=True),
    "aminmax": lambda x: tuple(torch.aminmax(x)),
    "aminmax_dim": lambda x: tuple(torch.aminmax(x, dim=-1, keepdim=True)),
    "any_all": lambda x: x.any(),
    "all_dim": lambda x: x.all(1),
    "any_dims": lambda x: torch.any(x, (0, 1), keepdim=True),
    "count_nonzero": lambda x: torch.count_nonzero(x, 0),
    "count_nonzero_all": lambda x: torch.count_nonzero(x),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize(
    "x", [_floats(), INTS, INTS > 0, INTS.to(torch.uint8), STRIDED, FLOAT.bfloat16()],
    ids=["float_nan", "int64", "bool", "uint8", "strided", "bfloat16"],
)
def test_reduction(name, x):
    fn = REDUCTIONS[name]
    try:
        fn(x)
    except RuntimeError:
        pytest.skip(f"{name} rejects {x.dtype} on CPU too")
    same_as_cpu(fn, x)


@pytest.mark.parametrize("name", ["sum_all", "sum_dim", "mean_all", "prod_all", "amax", "max_dim", "argmax_all",
                                  "any_all", "count_nonzero", "nansum", "aminmax"])
def test_zero_dim(name):
    fn = REDUCTIONS[name]
    try:
        fn(SCALAR)
    except (RuntimeError, IndexError):
        pytest.skip(f"{name} rejects a 0-dim tensor on CPU too")
    same_as_cpu(fn, SCALAR)


@pytest.mark.parametrize("fn", [
    lambda x: x.sum(), lambda x: x.sum(1), lambda x: x.mean(0), lambda x: x.prod(1), lambda x: x.var(0),
    lambda x: x.amax(0), lambda x: x.any(1), lambda x: x.all(), lambda x: torch.logsumexp(x, 1),
    lambda x: torch.linalg.vector_norm(x, 2, 1), lambda x: x.mean(),
], ids=["sum", "sum_dim", "mean_dim", "prod", "var", "amax_nonempty_dim", "any", "all", "logsumexp", "norm", "mean_all"])
def test_empty(fn):
    same_as_cpu(fn, EMPTY)


def test_first_index_ties():
    same_as_cpu(lambda x: tuple(torch.max(x, 1)), TIES)
    same_as_cpu(lambda x: tuple(torch.min(x, 1)), TIES)
    same_as_cpu(lambda x: (x.argmax(), x.argmin(), x.argmax(1), x.argmin(0)), TIES)


def test_nan_wins_extrema_with_its_first_index():
    x = torch.tensor([[1.0, NAN, 5.0, NAN], [INF, -INF, 2.0, 0.0]])
    same_as_cpu(lambda t: (tuple(t.max(1)), tuple(t.min(1)), t.argmax(1), t.argmin(1), t.amax(1), t.amin()), x)


def test_integer_sums_accumulate_in_int64_and_wrap():
    big = torch.full((4,), 2**30, dtype=torch.int32)
    same_as_cpu(lambda x: (x.sum(), x.cumsum(0)), big)
    wraps = torch.tensor([2**62, 2**62, 2**62])
    same_as_cpu(lambda x: (x.sum(), x.prod()), wraps)
    same_as_cpu(lambda x: x.sum(dtype=torch.int8), torch.tensor([100, 100, 100], dtype=torch.int16))


@pytest.mark.parametrize("correction", [0, 1, 2, 1.5])
@pytest.mark.parametrize("dim", [None, 0, (0, 2), []])
def test_variance_family(correction, dim):
    kwargs = dict(dim=dim, correction=correction)
    same_as_cpu(lambda x: (torch.var(x, **kwargs), torch.std(x, **kwargs)), FLOAT)
    same_as_cpu(lambda x: (torch.var_mean(x, **kwargs, keepdim=True), torch.std_mean(x, **kwargs)), FLOAT)


def test_variance_of_too_few_elements_is_inf_or_nan():
    same_as_cpu(lambda x: (x.var(), x.std(0), torch.var_mean(x, correction=3)), torch.tensor([[1.0, 2.0]]))


def test_bfloat16_accumulates_in_float32():
    x = torch.full((4096,), 1.0, dtype=torch.bfloat16) + torch.rand(4096, generator=torch.Generator().manual_seed(1)).bfloat16()
    same_as_cpu(lambda t: (t.sum(), t.mean(), t.var(), torch.linalg.vector_norm(t), t.prod(0).float()), x)


@pytest.mark.parametrize("ord", [0, 1, 2, 3, 0.5, -1, INF, -INF])
def test_vector_norm(ord):
    x = FLOAT.clone()
    x[0, 0, :2] = 0
    same_as_cpu(lambda t: (torch.linalg.vector_norm(t, ord), torch.linalg.vector_norm(t, ord, (0, 2), keepdim=True)), x)
    same_as_cpu(lambda t: torch.linalg.vector_norm(t, ord, dtype=torch.float64), x)


def test_norm_and_dist():
    same_as_cpu(lambda x: (x.norm(), x.norm(1, 1), x.norm(INF), x.norm(3, (0, 1), keepdim=True), x.norm(p="fro")), FLOAT)
    same_as_cpu(lambda x, y: (torch.dist(x, y), torch.dist(x, y, 1), torch.dist(x, y, INF)), FLOAT, FLOAT.flip(0))


def test_logsumexp_handles_infinities():
    x = torch.tensor([[-INF, -INF, -INF], [INF, 1.0, 2.0], [NAN, 0.0, 1.0], [1000.0, 1000.0, -1000.0]])
    same_as_cpu(lambda t: (torch.logsumexp(t, 1), torch.logsumexp(t, (0, 1), keepdim=True)), x)
    same_as_cpu(lambda t: torch.logsumexp(t, 0), INTS)


def test_mean_dtype_argument_converts_first():
    same_as_cpu(lambda x: (x.mean(1, dtype=torch.float32), x.sum(1, dtype=torch.float32)), INTS)
    same_as_cpu(lambda x: x.mean(dtype=torch.float64), FLOAT.bfloat16())


def test_any_all_keep_uint8_and_reduce_nothing_over_empty_dims():
    same_as_cpu(lambda x: (x.any(0), x.all(), torch.any(x, ()), torch.all(x, ())), INTS.to(torch.uint8))
    same_as_cpu(lambda x: (x.any(1), x.all(1)), torch.tensor([[NAN, 0.0], [0.0, -0.0]]))


def test_out_variants_write_through_the_executor():
    def outs(x, *shapes, dtypes=()):
        return tuple(torch.empty(s, dtype=d, device=x.device) for s, d in zip(shapes, dtypes or [x.dtype] * len(shapes)))

    same_as_cpu(lambda x: torch.sum(x, (1, 2), out=outs(x, 4)[0]), FLOAT)
    same_as_cpu(lambda x: torch.mean(x, 1, out=outs(x, (4, 5))[0]), FLOAT)
    same_as_cpu(lambda x: torch.std(x, 0, out=outs(x, (6, 5))[0]), FLOAT)
    same_as_cpu(lambda x: torch.amax(x, 1, out=outs(x, (4, 5))[0]), FLOAT)
    same_as_cpu(lambda x: torch.max(x, 0, out=outs(x, (6, 5), (6, 5), dtypes=(x.dtype, torch.long))), FLOAT)
    same_as_cpu(lambda x: torch.any(x, 1, out=outs(x, 3, dtypes=(torch.bool,))[0]), INTS)
    # out= into a non-contiguous view of a larger tensor
    same_as_cpu(lambda x: torch.sum(x, 2, out=outs(x, (6, 4))[0].t()), FLOAT)


GRADIENTS = [
    pytest.param(lambda x: x.sum(1), id="sum"),
    pytest.param(lambda x: x.mean((0, 2)), id="mean"),
    pytest.param(lambda x: x.prod(1), id="prod"),
    pytest.param(lambda x: x.var(0), id="var"),
    pytest.param(lambda x: torch.std_mean(x, 1)[0], id="std_mean"),
    pytest.param(lambda x: x.amax(1), id="amax"),
    pytest.param(lambda x: x.max(2)[0], id="max_dim"),
    pytest.param(lambda x: torch.logsumexp(x, 0), id="logsumexp"),
    pytest.param(lambda x: torch.linalg.vector_norm(x, 2, 1), id="vector_norm_2"),
    pytest.param(lambda x: torch.linalg.vector_norm(x, 3, 1), id="vector_norm_3"),  # backward calls pow_
]


def input_gradient(fn):
    """x -> the gradient of `fn` at x for a fixed cotangent (a VJP), to compare backward kernels."""

    def grad(x):
        x = x.detach().requires_grad_()
        out = fn(x)
        cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(x.device)
        return torch.autograd.grad(out, x, cotangent)[0]

    return grad


@pytest.mark.parametrize("fn", GRADIENTS)
def test_gradient(fn):
    same_as_cpu(input_gradient(fn), FLOAT)
