"""FBGEMM's data-distribution ops on `tpu` tensors against FBGEMM's CPU kernels: values, and the
gradient of the pooled-embedding permutations (column-wise sharding's output)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")

from torchtpu import counters  # noqa: E402
from torchtpu.ops import fbgemm  # noqa: E402

fbgemm.install()
ops = torch.ops.fbgemm


def _tpu(*tensors):
    return [None if t is None else t.to("tpu") for t in tensors]


def _same(got, expected):
    for g, e in zip(got if isinstance(got, (tuple, list)) else [got], expected if isinstance(expected, (tuple, list)) else [expected]):
        assert (g is None) == (e is None)
        if e is not None:
            assert g.device.type == "tpu"
            torch.testing.assert_close(g.cpu(), e, rtol=0, atol=0)


def _permutation_args(dims, permute):
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(dims)]), dtype=torch.int64)
    inverse = list(np.argsort(permute))
    inv_offsets = torch.tensor(np.concatenate([[0], np.cumsum([dims[p] for p in permute])]), dtype=torch.int64)
    return offsets, torch.tensor(permute), inv_offsets, torch.tensor(inverse)


@pytest.mark.parametrize("name", fbgemm.PERMUTE_POOLED)
def test_permute_pooled_embs_values_and_gradient(name):
    dims, permute = [3, 4, 2, 5], [2, 0, 3, 1]
    args = _permutation_args(dims, permute)
    pooled = torch.randn(6, sum(dims), dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    cotangent = torch.randn(6, sum(dims), generator=torch.Generator().manual_seed(1))
    op = getattr(ops, name)
    cpu_in = pooled.clone().requires_grad_("auto_grad" in name)
    expected = op(cpu_in, *args)
    tpu_in = pooled.to("tpu").requires_grad_("auto_grad" in name)
    got = op(tpu_in, *_tpu(*args))
    _same(got.detach(), expected.detach())
    if "auto_grad" in name:
        (expected * cotangent).sum().backward()
        (got * cotangent.to("tpu")).sum().backward()
        torch.testing.assert_close(tpu_in.grad.cpu(), cpu_in.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["asynchronous_complete_cumsum", "asynchronous_exclusive_cumsum",
                                  "asynchronous_inclusive_cumsum"])
def test_cumsums(name):
    lengths = torch.tensor([3, 0, 2, 7, 1], dtype=torch.int64)
    _same(getattr(ops, name)(lengths.to("tpu")), getattr(ops, name)(lengths))


def _jagged(rng, features=3, batch=4):
    lengths = torch.from_numpy(rng.integers(0, 4, size=(features, batch)).astype(np.int64))
    values = torch.from_numpy(rng.integers(0, 100, size=int(lengths.sum())).astype(np.int64))
    weights = torch.from_numpy(rng.uniform(size=int(lengths.sum())).astype(np.float32))
    return lengths, values, weights


def test_permute_2D_sparse_data_is_staged_through_the_host():
    lengths, values, weights = _jagged(np.random.default_rng(0))
    permute = torch.tensor([2, 0, 1], dtype=torch.int32)
    counters.reset()
    got = ops.permute_2D_sparse_data(*_tpu(permute, lengths, values, weights))
    _same(got, ops.permute_2D_sparse_data(permute, lengths, values, weights))
    assert "permute_2D_sparse_data" in str(counters.snapshot())


def test_block_bucketize_sparse_features():
    lengths, values, weights = _jagged(np.random.default_rng(1))
    lengths = lengths.reshape(-1)
    block_sizes = torch.tensor([50, 50, 50], dtype=torch.int64)
    args = (lengths, values, False, False, block_sizes, 2, weights)
    expected = ops.block_bucketize_sparse_features(*args)
    got = ops.block_bucketize_sparse_features(*_tpu(lengths, values), False, False, block_sizes.to("tpu"), 2,
                                              weights.to("tpu"))
    _same(got, expected)
