"""Pairwise distances on `tpu` against PyTorch's CPU kernels: cdist for p in {0, 1, 1.5, 2, 3,
inf}, batch broadcasting, the matmul route ATen takes for p = 2, coincident points (gradient 0),
pdist, and the composites built on them (pairwise_distance, cosine_similarity)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401
from value_and_grad import Draws, values_and_grads_match as check

DRAWS = Draws(0)
GEN, randn = DRAWS.generator, DRAWS.randn




@pytest.mark.parametrize("p", [0.0, 1.0, 1.5, 2.0, 3.0, math.inf])
def test_cdist(p):
    check(lambda a, b: torch.cdist(a, b, p=p), randn(2, 4, 3), randn(2, 5, 3))
    check(lambda a, b: torch.cdist(a, b, p=p), randn(3, 1, 4, 3), randn(2, 5, 3))  # broadcast


def test_cdist_matmul_route():
    a, b = randn(30, 3), randn(6, 3)
    for mode in ("use_mm_for_euclid_dist_if_necessary", "use_mm_for_euclid_dist",
                 "donot_use_mm_for_euclid_dist"):
        check(lambda x, y: torch.cdist(x, y, compute_mode=mode), a, b)
    with torch.tpu.precision("highest"):
        same_as_cpu(lambda x, y: torch.cdist(x, y, compute_mode="use_mm_for_euclid_dist"),
                    a.float(), b.float(), exact=False)


def test_coincident_points_have_zero_gradient():
    a = torch.tensor([[0.0, 1.0], [2.0, 2.0]], dtype=torch.float64)
    for p in (1.0, 2.0, 0.5, 3.0, math.inf):
        grads_same_as_cpu(lambda x, y: torch.cdist(x, y, p=p), a, a.clone())
        grads_same_as_cpu(lambda x: F.pdist(torch.cat([x, x]), p=p), a)


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5, 2.0, math.inf])
def test_pdist(p):
    check(lambda x: F.pdist(x, p=p), randn(6, 3))
    same_as_cpu(lambda x: F.pdist(x), randn(1, 3), exact=False)  # no pairs


def test_composites():
    check(lambda a, b: F.pairwise_distance(a, b, p=2.0), randn(4, 5), randn(4, 5))
    check(lambda a, b: F.cosine_similarity(a, b, dim=1), randn(4, 5), randn(4, 5))
