"""Shared by the tests of the matmul/linear-algebra, convolution, nn, loss, distance, pooling and
resampling lowerings: seeded float64 draws (one generator per test module, so a test's inputs do
not depend on which other modules run) and one check of values and gradients against CPU."""

from __future__ import annotations

import torch

from cpu_reference import grads_same_as_cpu, same_as_cpu


class Draws:
    """Random tensors from one seeded generator; float64 unless asked otherwise, so comparisons
    test the math rather than float32 rounding or matmul precision modes."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, dtype=dtype)

    def rand(self, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, dtype=dtype)


def values_and_grads_match(fn, *args) -> None:
    """`fn` on `tpu` copies of `args` equals `fn` on CPU (within default tolerances), and so do
    the gradients of its output with respect to every floating-point argument."""
    same_as_cpu(fn, *args, exact=False)
    grads_same_as_cpu(fn, *args)
