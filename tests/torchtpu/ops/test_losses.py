"""Losses on `tpu` against PyTorch's CPU kernels: every reduction, class weights and
ignore_index, 1-d/2-d/unbatched inputs, probabilities at 0 and 1, out-of-range targets (NaN
instead of a silent clamp), bf16, and gradients through each backward op."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401
from value_and_grad import Draws, values_and_grads_match as check

aten = torch.ops.aten
DRAWS = Draws(0)
GEN, randn, rand = DRAWS.generator, DRAWS.randn, DRAWS.rand
REDUCTIONS = ["none", "mean", "sum"]





@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss(reduction, weighted):
    target = torch.tensor([0, 2, 4, 1, -100, 3])
    weight = rand(5) if weighted else None
    fn = lambda x: F.nll_loss(x, target.to(x.device), weight=None if weight is None else weight.to(x.device), reduction=reduction)  # noqa: E731
    check(fn, torch.log_softmax(randn(6, 5), 1))
    # 2-d (images) and a single unbatched sample, with a class index as ignore_index.
    target2d = torch.randint(0, 5, (2, 3, 4), generator=GEN)
    check(lambda x: F.nll_loss(x, target2d.to(x.device), reduction=reduction, ignore_index=2),
          randn(2, 5, 3, 4))
    check(lambda x: F.nll_loss(x, torch.tensor(3, device=x.device), reduction=reduction), randn(5))


def test_nll_loss_all_ignored_and_out_of_range():
    x = randn(3, 4)
    same_as_cpu(lambda v: F.nll_loss(v, torch.full((3,), -100, device=v.device)), x, exact=False)
    # An out-of-range class cannot raise on the device; it poisons its sample with NaN.
    losses = F.nll_loss(x.to("tpu"), torch.tensor([0, 7, 1], device="tpu"), reduction="none").cpu()
    assert math.isnan(losses[1]) and not losses[[0, 2]].isnan().any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy(reduction):
    target = torch.tensor([0, 2, 4, 1])
    check(lambda x: F.cross_entropy(x, target.to(x.device), reduction=reduction, label_smoothing=0.2),
          randn(4, 5))
    probabilities = torch.softmax(randn(4, 5), 1)
    check(lambda x, p: F.cross_entropy(x, p, reduction=reduction), randn(4, 5), probabilities)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "loss",
    [
        F.mse_loss,
        F.l1_loss,
        lambda a, b, reduction: F.smooth_l1_loss(a, b, reduction=reduction, beta=0.5),
        lambda a, b, reduction: F.smooth_l1_loss(a, b, reduction=reduction, beta=0.0),
        lambda a, b, reduction: F.huber_loss(a, b, reduction=reduction, delta=0.7),
        # Its device-generic kernel writes into an `empty({0})` out= tensor, resized to the result.
        F.soft_margin_loss,
    ],
)
def test_regression_losses(loss, reduction):
    a, b = randn(4, 5), randn(4, 5)
    if loss is F.soft_margin_loss:  # a target of +-1, not differentiable
        target = b.sign()
        check(lambda a: loss(a, target.to(a.device), reduction=reduction), a)
    else:
        check(lambda a, b: loss(a, b, reduction=reduction), a, b)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_soft_margin_loss_of_0_dim_tensors(reduction):
    x = torch.tensor(-0.75, dtype=torch.float64)
    check(lambda a: F.soft_margin_loss(a, torch.ones((), dtype=a.dtype, device=a.device), reduction=reduction), x)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_binary_cross_entropy(reduction):
    p, t, w = rand(4, 5), rand(4, 5), rand(5)
    check(lambda p, t: F.binary_cross_entropy(p, t, weight=w.to(p.device), reduction=reduction), p, t)
    # Probabilities of exactly 0 and 1: log terms are clamped at -100, as in PyTorch.
    edges = torch.tensor([0.0, 1.0, 0.5, 1.0], dtype=torch.float64)
    same_as_cpu(lambda p, t: F.binary_cross_entropy(p, t, reduction=reduction), edges,
                torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), exact=False)
    logits, pos_weight = randn(4, 5) * 30, rand(5) * 3
    check(lambda x, t: F.binary_cross_entropy_with_logits(
        x, t, weight=w.to(x.device), pos_weight=pos_weight.to(x.device), reduction=reduction), logits, t)


@pytest.mark.parametrize("reduction", ["none", "batchmean", "sum", "mean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div(reduction, log_target):
    target = torch.log_softmax(randn(3, 4), 1) if log_target else torch.softmax(randn(3, 4), 1)
    check(lambda x, t: F.kl_div(x, t, reduction=reduction, log_target=log_target),
          torch.log_softmax(randn(3, 4), 1), target)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("p", [1, 2])
def test_multi_margin_loss(reduction, p):
    target, weight = torch.tensor([1, 0, 4, 2]), rand(5)
    check(lambda x: F.multi_margin_loss(x, target.to(x.device), p=p, margin=0.8,
                                        weight=weight.to(x.device), reduction=reduction), randn(4, 5))
    # One sample, unreduced: PyTorch's meta kernel (which the device follows) says shape (1,),
    # its CPU kernel returns a 0-dim tensor; the values agree.
    check(lambda x: F.multi_margin_loss(x, torch.tensor(3, device=x.device), p=p,
                                        reduction=reduction).reshape(-1), randn(5))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_multilabel_margin_loss(reduction):
    # Each target list ends at its first -1; later entries are ignored.
    target = torch.tensor([[1, 3, -1, 0, 0], [0, 1, 2, 3, 4], [-1, 0, 0, 0, 0], [4, -1, 1, 1, 1]])
    check(lambda x: F.multilabel_margin_loss(x, target.to(x.device), reduction=reduction),
          randn(4, 5))
    check(lambda x: F.multilabel_margin_loss(x, torch.tensor([3, 0, -1, 1], device=x.device),
                                             reduction="sum" if reduction == "none" else reduction),
          randn(4))


SIGNS = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
LABELS = (torch.rand(4, 5, generator=GEN) > 0.5).double()


@pytest.mark.parametrize(
    "loss, arity",
    [
        (lambda a, b: F.margin_ranking_loss(a, b, SIGNS[:, None].to(a.device), margin=0.3), 2),
        (lambda a, b: F.cosine_embedding_loss(a, b, SIGNS.to(a.device)), 2),
        (lambda a, b, c: F.triplet_margin_loss(a, b, c, margin=0.5), 3),
        (lambda a: F.hinge_embedding_loss(a, LABELS.to(a.device) * 2 - 1), 1),
        (lambda a, t: F.poisson_nll_loss(a, t.abs()), 2),
        (lambda a, b, t: F.gaussian_nll_loss(a, t, b.abs() + 0.1), 3),
        (lambda a: F.multilabel_soft_margin_loss(a, LABELS.to(a.device)), 1),
    ],
)
def test_composite_losses(loss, arity):
    check(loss, *[randn(4, 5) for _ in range(arity)])


def test_losses_in_bf16():
    x, t = randn(4, 5, dtype=torch.float32).bfloat16(), randn(4, 5, dtype=torch.float32).bfloat16()
    same_as_cpu(F.mse_loss, x, t, exact=False)
    same_as_cpu(lambda a: F.cross_entropy(a, torch.tensor([1, 0, 3, 2], device=a.device)), x, exact=False)
    same_as_cpu(F.binary_cross_entropy_with_logits, x, t.sigmoid(), exact=False)


def test_weight_norm_interface_backward():
    v, g = randn(4, 3, 2), randn(4, 1, 1)
    w, norms = aten._weight_norm_interface(v, g, 0)
    same_as_cpu(lambda *a: aten._weight_norm_interface_backward(*a, 0), randn(4, 3, 2), v, g, norms,
                exact=False)
    grads_same_as_cpu(lambda v, g: torch._weight_norm(v, g, 0), v, g)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss(reduction, zero_infinity):
    log_probs = torch.log_softmax(randn(12, 3, 6), 2)
    padded = torch.randint(1, 6, (3, 5), generator=GEN)
    # With zero_infinity the last alignment is impossible (a target longer than its input):
    # its loss is inf, zeroed with its gradient. Without, inf losses have NaN gradients on CPU.
    lengths_in, lengths_target = [12, 9, 4 if zero_infinity else 7], [5, 3, 5]
    fn = lambda lp, t, i, tl: F.ctc_loss(lp, t, i, tl, reduction=reduction, zero_infinity=zero_infinity)  # noqa: E731
    check(lambda lp: fn(lp, padded.to(lp.device), lengths_in, lengths_target), log_probs)
    concatenated = torch.cat([padded[0, :5], padded[1, :3], padded[2, :5]])
    check(lambda lp: fn(lp, concatenated.to(lp.device), lengths_in, lengths_target), log_probs)
    # Lengths as tensors (read to the host once) and a blank other than 0.
    check(lambda lp: F.ctc_loss(lp, padded.to(lp.device) - 1, torch.tensor(lengths_in, device=lp.device),
                                torch.tensor(lengths_target, device=lp.device), blank=5,
                                reduction=reduction, zero_infinity=zero_infinity), log_probs)


def test_ctc_loss_impossible_alignment_is_infinite():
    log_probs = torch.log_softmax(randn(3, 1, 4), 2)
    same_as_cpu(lambda lp: F.ctc_loss(lp, torch.tensor([[1, 2, 3, 1]], device=lp.device), [3], [4],
                                      reduction="none"), log_probs, exact=False)
