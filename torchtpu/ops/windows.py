"""Window functions: `torch.hamming_window`, `blackman_window`, `bartlett_window` and
`kaiser_window`, the tapers of spectral analysis (`hann_window` runs as PyTorch's decomposition).

Each is `arange(N)` -- `N + 1` points for a periodic window, whose last one is dropped -- mapped
elementwise as ATen's kernel maps it: step by step in the output dtype, each step computed in
opmath (float32 for bf16/f16) and rounded, so values agree with the CPU's but for the last bit
of `cos` and `i0`. Windows of length 0 and 1 are `[]` and `[1]`. In eager mode PyTorch's
composite kernels ran the first three (through lowered ops), while `kaiser_window`'s kernel is
a CPU/CUDA dispatch stub and failed on tpu with an internal assert; compiled graphs hold the ops
themselves. The meta kernels check the arguments (a floating-point dtype, a length >= 0).
"""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp
import jax.scipy.special
import torch

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


def _window(ctx, window_length: int, periodic: bool, taper: Callable) -> jnp.ndarray:
    """`taper(positions, length, step)` over the window's points, where `step(fn, *operands)`
    computes `fn` in opmath and rounds to the output dtype, as each of ATen's in-place steps does."""
    dtype = ctx.out_dtype()
    if window_length <= 1:
        return jnp.ones((window_length,), dtype)
    length = window_length + 1 if periodic else window_length
    compute = opmath(dtype)

    def step(fn: Callable, *operands) -> jnp.ndarray:
        return fn(*(jnp.asarray(x).astype(compute) for x in operands)).astype(dtype)

    window = taper(jnp.arange(length, dtype=dtype), length, step)
    return window[:window_length]


@registry.register(aten.hamming_window.default, aten.hamming_window.periodic, aten.hamming_window.periodic_alpha,
                   aten.hamming_window.periodic_alpha_beta)
def hamming_window(ctx, window_length: int, periodic: bool = True, alpha: float = 0.54, beta: float = 0.46,
                   **options) -> jnp.ndarray:
    """`alpha - beta * cos(2 pi n / (N - 1))`."""

    def taper(n, length, step):
        w = step(jnp.cos, step(lambda x: x * (2 * math.pi / (length - 1)), n))
        return step(lambda x: x + alpha, step(lambda x: x * -beta, w))

    return _window(ctx, window_length, periodic, taper)


@registry.register(aten.blackman_window.default, aten.blackman_window.periodic)
def blackman_window(ctx, window_length: int, periodic: bool = True, **options) -> jnp.ndarray:
    """`0.42 - 0.5 cos(2 pi n / (N - 1)) + 0.08 cos(4 pi n / (N - 1))`."""

    def taper(n, length, step):
        w = step(lambda x: x * (math.pi / (length - 1)), n)
        term = lambda k, weight: step(lambda x: x * weight, step(jnp.cos, step(lambda x: x * k, w)))  # noqa: E731
        return step(lambda x: x + 0.42, step(jnp.subtract, term(4, 0.08), term(2, 0.5)))

    return _window(ctx, window_length, periodic, taper)


@registry.register(aten.bartlett_window.default, aten.bartlett_window.periodic)
def bartlett_window(ctx, window_length: int, periodic: bool = True, **options) -> jnp.ndarray:
    """The triangle `1 - |2n / (N - 1) - 1|`: `2n / (N - 1)` rising, then `2 - 2n / (N - 1)`."""

    def taper(n, length, step):
        w = step(lambda x: x * (2 / (length - 1)), n)
        falling = jnp.arange(length) >= ((length - 1) >> 1) + 1
        return jnp.where(falling, step(lambda x: 2 - x, w), w)

    return _window(ctx, window_length, periodic, taper)


@registry.register(aten.kaiser_window.default, aten.kaiser_window.periodic, aten.kaiser_window.beta)
def kaiser_window(ctx, window_length: int, periodic: bool = True, beta: float = 12.0, **options) -> jnp.ndarray:
    """`I0(beta sqrt(1 - ((n - a) / a)^2)) / I0(beta)` with `a = (N - 1) / 2`, in one opmath step."""

    def taper(n, length, step):
        half = (length - 1) / 2.0
        i0 = jax.scipy.special.i0

        def kaiser(x):
            return i0(beta * jnp.sqrt(jnp.abs(1 - ((x - half) / half) ** 2))) / i0(jnp.asarray(beta, x.dtype))

        return step(kaiser, n)

    return _window(ctx, window_length, periodic, taper)
