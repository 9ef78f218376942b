"""Resampling: upsample/interpolate (nearest, nearest-exact, linear, cubic, antialiased) and
grid_sampler 2d/3d, with their backward ops.

Resizing is separable: along each spatial dimension, output position `o` reads a few input
positions (taps) with weights, both fixed by the sizes, `align_corners` and the scales. The tap
tables are computed on the host with ATen's formulas, in the dtype ATen computes them in (float32
for float32/bf16/f16 inputs, float64 for float64), so results match the CPU kernels; the device
then gathers and weighs one dimension at a time. Every resize and grid sample is linear in its
input, so the backward ops are `jax.vjp` of the forward -- one copy of the math.
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


class Taps(NamedTuple):
    index: np.ndarray  # (out, taps) input positions
    weight: np.ndarray | None  # (out, taps); None: a single tap of weight 1


def _table_dtype(dtype) -> type:
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _scale_value(size: int, out: int, scale: float | None, dt) -> np.floating:
    """ATen's compute_scales_value: 1 / scale if given, else size / out."""
    if scale is not None and scale > 0:
        return dt(1.0 / scale)
    return dt(size) / dt(out)


def _area_scale(size: int, out: int, align_corners: bool, scale, dt) -> np.floating:
    """ATen's area_pixel_compute_scale."""
    if align_corners:
        return dt(size - 1) / dt(out - 1) if out > 1 else dt(0)
    return _scale_value(size, out, scale, dt)


def _source(scale, out: int, align_corners: bool, cubic: bool, dt) -> np.ndarray:
    """ATen's area_pixel_compute_source_index for every output position."""
    o = np.arange(out, dtype=dt)
    if align_corners:
        return scale * o
    src = scale * (o + dt(0.5)) - dt(0.5)
    return src if cubic else np.maximum(src, dt(0))


def _nearest(size, out, scale, dt, exact: bool) -> Taps:
    if out == size and not exact:
        index = np.arange(out)
    elif out == 2 * size and not exact:
        index = np.arange(out) >> 1
    else:
        s = _scale_value(size, out, scale, dt)
        o = np.arange(out, dtype=dt)
        index = np.floor(((o + dt(0.5)) if exact else o) * s).astype(np.int64)
    return Taps(np.minimum(index, size - 1)[:, None], None)


def _linear(size, out, align_corners, scale, dt) -> Taps:
    src = _source(_area_scale(size, out, align_corners, scale, dt), out, align_corners, False, dt)
    i0 = np.minimum(np.floor(src).astype(np.int64), size - 1)
    lam = np.clip(src - i0.astype(dt), dt(0), dt(1))
    i1 = i0 + (i0 < size - 1)
    return Taps(np.stack([i0, i1], 1), np.stack([dt(1) - lam, lam], 1))


def _cubic_weights(t, a: float = -0.75):
    """Cubic convolution weights of the taps at offsets -1, 0, 1, 2 from floor(x), for the
    fractional part t of x (numpy or jax arrays); ATen's A is -0.75."""

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _cubic(size, out, align_corners, scale, dt) -> Taps:
    src = _source(_area_scale(size, out, align_corners, scale, dt), out, align_corners, True, dt)
    base = np.floor(src)
    index = base.astype(np.int64)[:, None] + np.arange(-1, 3)[None, :]
    weights = np.stack(_cubic_weights(src - base), 1).astype(dt)
    return Taps(np.clip(index, 0, size - 1), weights)


def _aa_linear_filter(x):
    x = np.abs(x)
    return np.where(x < 1, 1 - x, 0)


def _aa_cubic_filter(x):
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0))


def _antialiased(size, out, align_corners, scale, dt, support_taps: int, filter_fn) -> Taps:
    """Antialiased taps (as PIL computes them): when downsampling the filter widens by the
    scale, so every input pixel contributes; weights are normalised per output position."""
    s = _area_scale(size, out, align_corners, scale, dt)
    support = (support_taps * 0.5) * s if s >= 1 else support_taps * 0.5
    inv = dt(1) / s if s >= 1 else dt(1)
    center = s * (np.arange(out, dtype=dt) + dt(0.5))
    lo = np.maximum((center - support + dt(0.5)).astype(np.int64), 0)
    hi = np.minimum((center + support + dt(0.5)).astype(np.int64), size)
    taps = int((hi - lo).max()) if out else 0
    j = np.arange(taps)
    index = lo[:, None] + j[None, :]
    weight = filter_fn((index - center[:, None] + dt(0.5)) * inv).astype(dt)
    weight = np.where(index < hi[:, None], weight, dt(0))
    total = weight.sum(1, keepdims=True)
    weight = np.where(total != 0, weight / np.where(total != 0, total, 1), weight).astype(dt)
    return Taps(np.minimum(index, size - 1), weight)


_KINDS: dict[str, Callable[..., Taps]] = {
    "nearest": lambda size, out, align, scale, dt: _nearest(size, out, scale, dt, False),
    "nearest_exact": lambda size, out, align, scale, dt: _nearest(size, out, scale, dt, True),
    "linear": _linear,
    "cubic": _cubic,
    "linear_aa": lambda *a: _antialiased(*a, 2, _aa_linear_filter),
    "cubic_aa": lambda *a: _antialiased(*a, 4, _aa_cubic_filter),
}


def _resize(x, kind: str, output_size: Sequence[int], align_corners: bool, scales):
    """Resize the last len(output_size) dims of `x` (already in its compute dtype)."""
    n = len(output_size)
    dt = _table_dtype(x.dtype)
    for d in range(n):
        axis = x.ndim - n + d
        taps = _KINDS[kind](x.shape[axis], output_size[d], align_corners, scales[d], dt)
        moved = jnp.moveaxis(x, axis, -1)[..., taps.index]
        if taps.weight is None:
            out = moved[..., 0]
        else:
            out = jnp.sum(moved * taps.weight.astype(x.dtype), -1)
        x = jnp.moveaxis(out, -1, axis)
    return x


def _register_resize(kind: str, n: int, forward, vec, backward, align: bool) -> None:
    """Register one interpolation mode's forward, `.vec` and backward overloads."""

    def run(ctx, x, output_size, align_corners, scales):
        scales = tuple(scales) if scales else (None,) * n
        out = ctx.out_shape()[-n:]
        return _resize(x.astype(opmath(x.dtype)), kind, out, align_corners, scales)

    def grad(ctx, g, output_size, input_size, align_corners, scales):
        scales = tuple(scales) if scales else (None,) * n
        compute = opmath(g.dtype)
        _, vjp = jax.vjp(
            lambda v: _resize(v, kind, tuple(output_size), align_corners, scales),
            jnp.zeros(tuple(input_size), compute),
        )
        return vjp(g.astype(compute))[0]

    if align:
        registry.register(forward)(
            lambda ctx, x, size, align_corners, *s: run(ctx, x, size, align_corners, s))
        registry.register(vec)(
            lambda ctx, x, size, align_corners, factors: run(ctx, x, size, align_corners, factors))
        registry.register(backward)(
            lambda ctx, g, size, in_size, align_corners, *s: grad(ctx, g, size, in_size,
                                                                  align_corners, s))
    else:
        registry.register(forward)(lambda ctx, x, size, *s: run(ctx, x, size, False, s))
        registry.register(vec)(lambda ctx, x, size, factors: run(ctx, x, size, False, factors))
        registry.register(backward)(
            lambda ctx, g, size, in_size, *s: grad(ctx, g, size, in_size, False, s))


for _n, _suffix in ((1, "1d"), (2, "2d"), (3, "3d")):
    for _kind, _name in (("nearest", "upsample_nearest"), ("nearest_exact", "_upsample_nearest_exact")):
        _packet = getattr(aten, _name + _suffix)
        _register_resize(_kind, _n, _packet.default, _packet.vec,
                         getattr(aten, _name + _suffix + "_backward").default, align=False)

for _n, _name, _kind in (
    (1, "upsample_linear1d", "linear"),
    (2, "upsample_bilinear2d", "linear"),
    (3, "upsample_trilinear3d", "linear"),
    (2, "upsample_bicubic2d", "cubic"),
    (2, "_upsample_bilinear2d_aa", "linear_aa"),
    (2, "_upsample_bicubic2d_aa", "cubic_aa"),
):
    _packet = getattr(aten, _name)
    _register_resize(_kind, _n, _packet.default, _packet.vec,
                     getattr(aten, _name + "_backward").default, align=True)


# --- grid sampling ----------------------------------------------------------------------------

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2


def _clip(x, size: int):
    # Written with `where` so that, as in ATen, the gradient is 0 on and beyond the borders.
    return jnp.where(x <= 0, jnp.zeros((), x.dtype), jnp.where(x >= size - 1, size - 1, x))


def _reflect(x, twice_low: int, twice_high: int):
    """Reflect x into [twice_low / 2, twice_high / 2] (ATen's reflect_coordinates)."""
    if twice_low == twice_high:
        return jnp.zeros_like(x)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    x = jnp.where(x < low, low - x, x - low)
    extra = jnp.fmod(x, span)
    flips = jnp.floor(x / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad_coordinate(x, size: int, padding_mode: int, align_corners: bool):
    if padding_mode == BORDER:
        return _clip(x, size)
    if padding_mode == REFLECTION:
        if align_corners:
            return _reflect(x, 0, 2 * (size - 1))
        return _clip(_reflect(x, -1, 2 * size - 1), size)
    return x


def _unnormalize(coord, size: int, align_corners: bool):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _grid_taps(coord, size: int, mode: int, padding_mode: int, align_corners: bool):
    """[(integer position, weight)] along one dimension for every grid point."""
    x = _unnormalize(coord, size, align_corners)
    if mode == BICUBIC:
        base = jnp.floor(x)
        return [(_pad_coordinate(base + k, size, padding_mode, align_corners), w)
                for k, w in zip(range(-1, 3), _cubic_weights(x - base))]
    x = _pad_coordinate(x, size, padding_mode, align_corners)
    if mode == NEAREST:
        return [(jnp.round(x), None)]
    base = jnp.floor(x)
    t = x - base
    return [(base, 1 - t), (base + 1, t)]


def _grid_sample(x, grid, mode: int, padding_mode: int, align_corners: bool):
    """Sample x (N, C, *spatial) at grid (N, *out, n) (coordinates in x, y[, z] order)."""
    n = grid.shape[-1]
    spatial = x.shape[2:]
    batch, channels = x.shape[:2]
    flat = x.reshape(batch, channels, -1)
    # Grid coordinate k addresses spatial dim n - 1 - k (x is the width, the last dim).
    per_dim = [_grid_taps(grid[..., n - 1 - d], spatial[d], mode, padding_mode, align_corners)
               for d in range(n)]
    out = jnp.zeros((batch, channels) + grid.shape[1:-1], x.dtype)
    for taps in itertools.product(*per_dim):
        valid = True
        index = jnp.zeros(grid.shape[:-1], np.int64)
        weight = None
        for d, (position, w) in enumerate(taps):
            valid = valid & (position >= 0) & (position <= spatial[d] - 1)
            index = index * spatial[d] + jnp.clip(position, 0, spatial[d] - 1).astype(np.int64)
            if w is not None:
                weight = w if weight is None else weight * w
        values = jnp.take_along_axis(flat, index.reshape(batch, 1, -1), -1)
        values = values.reshape(out.shape)
        contribution = values if weight is None else values * weight[:, None]
        out = out + jnp.where(valid[:, None], contribution, jnp.zeros((), x.dtype))
    return out


@registry.register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(ctx, x, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    compute = opmath(x.dtype)
    return _grid_sample(x.astype(compute), grid.astype(compute), interpolation_mode, padding_mode,
                        align_corners)


@registry.register(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(ctx, grad, x, grid, interpolation_mode: int, padding_mode: int,
                          align_corners: bool, output_mask: Sequence[bool]):
    compute = opmath(x.dtype)
    _, vjp = jax.vjp(
        lambda v, g: _grid_sample(v, g, interpolation_mode, padding_mode, align_corners),
        x.astype(compute), grid.astype(compute),
    )
    grad_input, grad_grid = vjp(grad.astype(compute))
    return (grad_input if output_mask[0] else None), (grad_grid if output_mask[1] else None)
