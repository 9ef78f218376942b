"""SyncBatchNorm's statistics ops on `tpu` (PyTorch has CUDA kernels only) against PyTorch's CPU
batch norm in float64: two "ranks" holding the halves of a batch combine to the whole batch's
statistics, running statistics and gradients. The multi-process run is
`tests/torchtpu/distributed/test_ddp.py::test_sync_batch_norm_matches_batch_norm_on_the_whole_batch`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_reference import strict_ops  # noqa: F401  (the autouse fixture)

EPS, MOMENTUM = 1e-5, 0.1
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 5), (4, 2, 3, 3)])
def test_two_halves_combine_to_the_whole_batch(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    weight = torch.rand(shape[1], generator=g, dtype=torch.float64) + 0.5
    bias = torch.randn(shape[1], generator=g, dtype=torch.float64)
    halves = [h.float().to("tpu") for h in x.split([2, shape[0] - 2])]
    stats = [torch.batch_norm_stats(h, EPS) for h in halves]
    counts = torch.tensor([float(h.numel() // h.shape[1]) for h in halves], device="tpu")
    running_mean, running_var = torch.zeros(shape[1], device="tpu"), torch.ones(shape[1], device="tpu")
    xt = x.float().to("tpu")
    mean, invstd = torch.batch_norm_gather_stats_with_counts(
        xt, torch.stack([m for m, _ in stats]), torch.stack([i for _, i in stats]), running_mean, running_var,
        MOMENTUM, EPS, counts)

    expected_running_mean = torch.zeros(shape[1], dtype=torch.float64)
    expected_running_var = torch.ones(shape[1], dtype=torch.float64)
    expected = F.batch_norm(x, expected_running_mean, expected_running_var, weight, bias, True, MOMENTUM, EPS)
    dims = [d for d in range(x.dim()) if d != 1]
    var, whole_mean = torch.var_mean(x, dims, correction=0)
    torch.testing.assert_close(mean.cpu().double(), whole_mean, **TOLERANCE)
    torch.testing.assert_close(invstd.cpu().double(), torch.rsqrt(var + EPS), **TOLERANCE)
    torch.testing.assert_close(running_mean.cpu().double(), expected_running_mean, **TOLERANCE)
    torch.testing.assert_close(running_var.cpu().double(), expected_running_var, **TOLERANCE)

    wt, bt = weight.float().to("tpu"), bias.float().to("tpu")
    out = torch.batch_norm_elemt(xt, wt, bt, mean, invstd, EPS)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE)

    # Backward: each half reduces, the sums add up (the all-reduce), each half applies them.
    grad_out = torch.randn(shape, generator=g, dtype=torch.float64)
    x_grad = x.clone().requires_grad_()
    w_grad, b_grad = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    F.batch_norm(x_grad, None, None, w_grad, b_grad, True, MOMENTUM, EPS).backward(grad_out)
    grad_halves = [g_.float().to("tpu") for g_ in grad_out.split([2, shape[0] - 2])]
    reduced = [torch.batch_norm_backward_reduce(gh, h, mean, invstd, wt, True, True, True)
               for gh, h in zip(grad_halves, halves)]
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = (sum(r[i] for r in reduced) for i in range(4))
    torch.testing.assert_close(grad_weight.cpu().double(), w_grad.grad, **TOLERANCE)
    torch.testing.assert_close(grad_bias.cpu().double(), b_grad.grad, **TOLERANCE)
    count = counts.to(torch.int32)
    grad_input = torch.cat([torch.batch_norm_backward_elemt(gh, h, mean, invstd, wt, sum_dy, sum_dy_xmu, count)
                            for gh, h in zip(grad_halves, halves)])
    torch.testing.assert_close(grad_input.cpu().double(), x_grad.grad, **TOLERANCE)
    # What is not asked for is not computed (None, PyTorch's undefined tensor).
    assert torch.batch_norm_backward_reduce(grad_halves[0], halves[0], mean, invstd, wt, True, False, False)[2:] == (
        None, None)
