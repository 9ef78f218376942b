"""Resampling on `tpu` against PyTorch's CPU kernels: interpolate in every mode (nearest,
nearest-exact, linear, bilinear, bicubic, trilinear, area), sizes and scale factors (up and
down, recomputed or not), align_corners, antialiasing, bf16; grid_sample 2d/3d in every mode
and padding mode; gradients for inputs and grids."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401
from value_and_grad import Draws, values_and_grads_match as check

DRAWS = Draws(0)
GEN, randn = DRAWS.generator, DRAWS.randn




SPATIAL = {"nearest": (1, 2, 3), "nearest-exact": (1, 2, 3), "linear": (1,), "bilinear": (2,),
           "bicubic": (2,), "trilinear": (3,), "area": (1, 2, 3)}
RESIZES = [dict(size=11), dict(scale_factor=2.0), dict(scale_factor=0.6),
           dict(scale_factor=1.7, recompute_scale_factor=True)]


@pytest.mark.parametrize("mode", SPATIAL)
@pytest.mark.parametrize("resize", RESIZES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_interpolate(mode, resize):
    aligns = (False, True) if mode in ("linear", "bilinear", "bicubic", "trilinear") else (None,)
    for n in SPATIAL[mode]:
        x = randn(2, 3, *(7, 6, 5)[:n])
        for align in aligns:
            kwargs = dict(resize, mode=mode)
            if align is not None:
                kwargs["align_corners"] = align
            check(lambda v: F.interpolate(v, **kwargs), x)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(3, 2), (11, 13), (5, 9)])
def test_antialiased_interpolate(mode, size):
    for align in (False, True):
        check(lambda v: F.interpolate(v, size=size, mode=mode, align_corners=align, antialias=True),
              randn(2, 3, 7, 6))


def test_interpolate_bf16_rounds_once():
    # bf16 in, float32 weights and sums, one rounding out: within half a bf16 ulp of the float32
    # result (PyTorch's CPU kernels round intermediate values and land further away).
    x = randn(1, 2, 6, 5).bfloat16()
    for mode in ("nearest", "bilinear", "bicubic"):
        actual = F.interpolate(x.to("tpu"), scale_factor=1.5, mode=mode).cpu()
        exact = F.interpolate(x.float(), scale_factor=1.5, mode=mode)
        assert actual.dtype == torch.bfloat16
        assert ((actual.float() - exact).abs() <= exact.abs() * 2**-8).all()


# Every mode with every padding mode; align_corners alternates.
GRID_2D = [(m, p, (i + j) % 2 == 0) for i, m in enumerate(["bilinear", "nearest", "bicubic"])
           for j, p in enumerate(["zeros", "border", "reflection"])]


@pytest.mark.parametrize("mode, padding_mode, align_corners", GRID_2D)
def test_grid_sample_2d(mode, padding_mode, align_corners):
    grid = torch.rand(2, 5, 4, 2, generator=GEN, dtype=torch.float64) * 2.4 - 1.2
    check(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode,
                                     align_corners=align_corners), randn(2, 3, 7, 6), grid)


@pytest.mark.parametrize("mode, padding_mode, align_corners", GRID_2D[:6])
def test_grid_sample_3d(mode, padding_mode, align_corners):
    grid = torch.rand(1, 3, 4, 2, 3, generator=GEN, dtype=torch.float64) * 2.4 - 1.2
    check(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode,
                                     align_corners=align_corners), randn(1, 2, 5, 4, 6), grid)


def test_grid_on_the_border_has_atens_subgradient():
    # Coordinates exactly on the border: ATen's clipped coordinate has gradient 0 there.
    grid = torch.tensor([[[[-1.0, 1.0], [1.0, -1.0], [0.25, 1.0]]]], dtype=torch.float64)
    check(lambda x, g: F.grid_sample(x, g, padding_mode="border", align_corners=True),
          randn(1, 2, 4, 5), grid)
