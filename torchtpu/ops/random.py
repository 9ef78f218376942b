"""Random ops: uniform, normal, bernoulli, dropout, random_, randperm, multinomial, ...

Every lowering here is registered `random=True` and draws from `ctx.rng_key()`, a threefry key
the executor derives from the device generator's (seed, offset) -- so `torch.manual_seed` and
`torch.tpu.get_rng_state`/`set_rng_state` reproduce streams, and the key being a runtime input,
a new draw never recompiles. Distribution parameters are runtime inputs too (`dynamic_scalars`).

The streams are JAX's, not PyTorch's (no backend reproduces CPU bits); the distributions are
ATen's, including their transformations of uniform bits (`random_`'s modulo reduction) and
their parameter conventions. Low-precision outputs are sampled in float32 and rounded.
An explicit `torch.Generator(device="tpu")` is a (seed, offset) pair of its own that the call
draws its key from instead (other devices' generators are refused). Value checks ATen does on
tensor data (negative probabilities, negative `std`) would need a host sync and are not done.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten


def _check_generator(ctx, generator) -> None:
    """A tpu generator reaches no lowering (the call draws its key from it and is keyed as having
    none, `opcall._is_tpu_generator`): any generator here is another device's."""
    if generator is not None:
        raise RuntimeError(
            f"{ctx.op}: expected a 'tpu' device type for generator but found '{generator.device}' "
            f"(pass torch.Generator(device='tpu'), or none to draw from the device's generator)"
        )


def _sampling_dtype(ctx) -> np.dtype:
    """Continuous draws are made in opmath, and in float32 for integer outputs (`geometric_`);
    complex normal draws in the complex dtype."""
    out = ctx.out_dtype()
    if jnp.issubdtype(out, jnp.complexfloating):
        return np.dtype(out)
    return opmath(out) if jnp.issubdtype(out, jnp.floating) else np.dtype(np.float32)


def _param(value, dtype):
    return jnp.asarray(value).astype(dtype)


def _uniform(ctx, low=0.0, high=1.0):
    """U[low, high) in the output dtype. Sampled in opmath; a draw that rounds up to `high` in
    the output dtype becomes the largest value below it (as CUDA's kernel does), so the
    interval stays half-open in bfloat16 too."""
    out, dtype = ctx.out_dtype(), _sampling_dtype(ctx)
    low, high = _param(low, dtype), _param(high, dtype)
    u = jax.random.uniform(ctx.rng_key(), ctx.out_shape(), dtype)
    value = (low + (high - low) * u).astype(out)
    top = high.astype(out)
    return jnp.where(value >= top, jnp.nextafter(top, low.astype(out)), value)


def _normal(ctx, mean=0.0, std=1.0):
    """N(mean, std). A complex draw is ATen's normal of its (real, imaginary) pair with std
    std/sqrt(2) and `mean` added to both parts (jax's complex normal: each part has variance 1/2)."""
    dtype = _sampling_dtype(ctx)
    z = jax.random.normal(ctx.rng_key(), ctx.out_shape(), dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        mean = _param(mean, dtype)
        return lax.complex(jnp.real(mean), jnp.real(mean)) + _param(std, dtype) * z
    return _param(mean, dtype) + _param(std, dtype) * z


# --- continuous distributions -------------------------------------------------------------------


def _check_uniform_range(x, low=0.0, high=1.0, *, generator=None) -> None:
    """ATen's CPU kernel (not the meta kernel) rejects an empty or inverted range."""
    if not low <= high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={low} > to={high}")


@registry.register(aten.uniform.default, random=True, dynamic_scalars=True, validate=_check_uniform_range)
def uniform(ctx, x, low=0.0, high=1.0, *, generator=None):
    _check_generator(ctx, generator)
    return _uniform(ctx, low, high)


@registry.register(
    aten.rand.default, aten.rand.generator, aten.rand_like.default, aten.rand_like.generator, random=True
)
def rand(ctx, size_or_self, *, generator=None, **options):
    _check_generator(ctx, generator)
    return _uniform(ctx)


@registry.register(
    aten.randn.default, aten.randn.generator, aten.randn_like.default, aten.randn_like.generator, random=True
)
def randn(ctx, size_or_self, *, generator=None, **options):
    _check_generator(ctx, generator)
    return _normal(ctx)


@registry.register(
    aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.normal.float_float,
    random=True, dynamic_scalars=True,
)
def normal(ctx, mean, std=1.0, size=None, *, generator=None, **options):
    """N(mean, std) with tensor or number parameters, broadcast to the output shape."""
    _check_generator(ctx, generator)
    return _normal(ctx, mean, std)


@registry.register(aten.normal_functional.default, random=True, dynamic_scalars=True)
def normal_functional(ctx, x, mean=0.0, std=1.0, *, generator=None):
    _check_generator(ctx, generator)
    return _normal(ctx, mean, std)


@registry.register(aten.log_normal.default, random=True, dynamic_scalars=True)
def log_normal(ctx, x, mean=1.0, std=2.0, *, generator=None):
    _check_generator(ctx, generator)
    return jnp.exp(_normal(ctx, mean, std))


@registry.register(aten.exponential.default, random=True, dynamic_scalars=True)
def exponential(ctx, x, lambd=1.0, *, generator=None):
    _check_generator(ctx, generator)
    dtype = _sampling_dtype(ctx)
    return jax.random.exponential(ctx.rng_key(), ctx.out_shape(), dtype) / _param(lambd, dtype)


@registry.register(aten.cauchy.default, random=True, dynamic_scalars=True)
def cauchy(ctx, x, median=0.0, sigma=1.0, *, generator=None):
    _check_generator(ctx, generator)
    dtype = _sampling_dtype(ctx)
    return _param(median, dtype) + _param(sigma, dtype) * jax.random.cauchy(ctx.rng_key(), ctx.out_shape(), dtype)


@registry.register(aten.geometric.default, random=True, dynamic_scalars=True)
def geometric(ctx, x, p, *, generator=None):
    """Number of Bernoulli(p) trials up to the first success: ceil(log(u) / log(1 - p)), u in (0, 1]."""
    _check_generator(ctx, generator)
    dtype = _sampling_dtype(ctx)
    u = 1 - jax.random.uniform(ctx.rng_key(), ctx.out_shape(), dtype)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-_param(p, dtype)))


def _gamma_draws(ctx, alpha, dtype):
    """Gamma(alpha, 1) draws in `dtype`; like ATen's, never below the smallest normal number."""
    sample = jax.random.gamma(ctx.rng_key(), alpha.astype(dtype), dtype=dtype)
    return jnp.maximum(sample, jnp.finfo(dtype).tiny)


@registry.register(aten._standard_gamma.default, random=True)
def standard_gamma(ctx, alpha, generator=None):
    """Gamma(alpha, 1)."""
    _check_generator(ctx, generator)
    return _gamma_draws(ctx, alpha, _sampling_dtype(ctx))


def _like_first(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Output metadata of the samplers PyTorch has no meta kernel for: the first argument's."""
    return torch.empty_like(x)


@registry.register(aten._standard_gamma_grad.default, meta=_like_first)
def standard_gamma_grad(ctx, alpha, sample):
    """The derivative of a Gamma(alpha, 1) sample with respect to alpha, holding its quantile
    (implicit reparameterization: `Gamma.rsample`'s backward). Not random itself."""
    dtype = _sampling_dtype(ctx)
    return lax.random_gamma_grad(alpha.astype(dtype), sample.astype(dtype))


@registry.register(aten._sample_dirichlet.default, random=True, meta=_like_first)
def sample_dirichlet(ctx, alpha, generator=None):
    """Dirichlet(alpha) over the last dimension (`Dirichlet` and `Beta` sample with it): Gamma
    draws normalized, as ATen's."""
    _check_generator(ctx, generator)
    gammas = _gamma_draws(ctx, alpha, _sampling_dtype(ctx))
    return gammas / gammas.sum(-1, keepdims=True)


# --- discrete distributions ---------------------------------------------------------------------


def _check_probability(x, p=None, *, generator=None) -> None:
    """ATen's CPU kernel (not the meta kernel) rejects a probability outside [0, 1]; a tensor of
    probabilities is not read to check it."""
    if isinstance(p, (int, float)) and not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")


@registry.register(aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor, random=True, dynamic_scalars=True,
                   validate=_check_probability)
def bernoulli(ctx, x, p=None, *, generator=None):
    """1 with probability `p` (a number, a tensor broadcast to `x`, or `x` itself), else 0."""
    _check_generator(ctx, generator)
    p = x if p is None else p
    dtype = np.dtype(np.float64) if ctx.out_dtype() == np.float64 else np.dtype(np.float32)
    return jax.random.uniform(ctx.rng_key(), ctx.out_shape(), dtype) < jnp.asarray(p).astype(dtype)


def _binomial_meta(count: torch.Tensor, prob: torch.Tensor, generator=None) -> torch.Tensor:
    return torch.empty(torch.broadcast_shapes(count.shape, prob.shape), dtype=count.dtype, device="meta")


@registry.register(aten.binomial.default, random=True, meta=_binomial_meta)
def binomial(ctx, count, prob, generator=None):
    """Successes in `count` trials of probability `prob` (`Binomial.sample`), elementwise."""
    _check_generator(ctx, generator)
    dtype = _sampling_dtype(ctx)
    count, prob = jnp.broadcast_arrays(count.astype(dtype), prob.astype(dtype))
    return jax.random.binomial(ctx.rng_key(), count, prob, count.shape, dtype)


@registry.register(aten.poisson.default, random=True)
def poisson(ctx, rate, generator=None):
    _check_generator(ctx, generator)
    rate = rate.astype(_sampling_dtype(ctx))
    return jax.random.poisson(ctx.rng_key(), rate, rate.shape)


def _digits(dtype) -> int:
    """Bits of a float's significand, the implicit one included (float32: 24)."""
    return jnp.finfo(dtype).nmant + 1


def _bounds(dtype) -> tuple[int, int]:
    """The integers `random_` may produce in `dtype`: its range for integers, [0, 1] for bool,
    and [-2**digits, 2**digits] for floats (every integer there is exact)."""
    if dtype == np.bool_:
        return 0, 1
    if jnp.issubdtype(dtype, jnp.floating):
        return -(2 ** _digits(dtype)), 2 ** _digits(dtype)
    info = jnp.iinfo(dtype)
    return int(info.min), int(info.max)


def _random_integers(ctx, low: int, span: int):
    """`low + bits % span` over 32 or 64 random bits, as ATen's `random_` transforms them;
    a span of 2**64 takes the 64 bits as they are."""
    key, shape = ctx.rng_key(), ctx.out_shape()
    if span < 2**32:
        bits = jax.random.bits(key, shape, np.uint32)
        return jnp.asarray(low, np.int64) + (bits % np.uint32(span)).astype(np.int64)
    bits = jax.random.bits(key, shape, np.uint64)
    offset = bits if span == 2**64 else bits % np.uint64(span)
    return lax.bitcast_convert_type(offset + np.uint64(low % 2**64), np.int64)


_RANDOM_FROM = getattr(aten.random, "from")  # `from` is a Python keyword


@registry.register(aten.random.default, aten.random.to, _RANDOM_FROM, random=True)
def random(ctx, x, from_or_to=None, to=None, *, generator=None):
    """Integers uniform over [from, to) (`random.from`; [from, max] without `to`), [0, to)
    (`random.to`), or [0, max] (`random.default`), max being the largest of `_bounds`."""
    _check_generator(ctx, generator)
    dtype = np.dtype(x.dtype)
    dtype_low, dtype_high = _bounds(dtype)
    if ctx.op is aten.random.to:
        low, high = 0, from_or_to - 1
    elif ctx.op is _RANDOM_FROM:
        low, high = from_or_to, (dtype_high if to is None else to - 1)
    else:
        low, high = 0, dtype_high
    _check_range(low, high, dtype_low, dtype_high, ctx.arg("self").dtype)
    return _random_integers(ctx, low, high - low + 1)


def _check_range(low: int, high: int, dtype_low: int, dtype_high: int, dtype) -> None:
    """ATen's checks of `random_(from, to)` (PyTorch's meta kernel does not make them)."""
    if high < low:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high + 1}")
    if not dtype_low <= low <= dtype_high:
        raise RuntimeError(f"from is out of bounds for {dtype}: {low} not in [{dtype_low}, {dtype_high}]")
    if not dtype_low <= high <= dtype_high:
        raise RuntimeError(f"to - 1 is out of bounds for {dtype}: {high} not in [{dtype_low}, {dtype_high}]")


def _randint(ctx, low: int, high: int, generator):
    """`randint` / `randint_like`: integers uniform over [low, high), drawn as `random_(low,
    high)` draws them, with its range checks. (PyTorch's composite kernel writes them as `empty`
    and `random_`; lowered, they also run inside compiled graphs -- negative sampling in a
    compiled model, say.)"""
    _check_generator(ctx, generator)
    dtype_low, dtype_high = _bounds(np.dtype(ctx.out_dtype()))
    _check_range(low, high - 1, dtype_low, dtype_high, ctx.out().dtype)
    return _random_integers(ctx, low, high - low)


@registry.register(aten.randint.default, aten.randint.generator, random=True)
def randint(ctx, high, size, *, generator=None, **options):
    return _randint(ctx, 0, high, generator)


@registry.register(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(ctx, low, high, size, *, generator=None, **options):
    return _randint(ctx, low, high, generator)


@registry.register(aten.randint_like.default, aten.randint_like.generator, random=True)
def randint_like(ctx, x, high, *, generator=None, **options):
    return _randint(ctx, 0, high, generator)


@registry.register(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, random=True)
def randint_like_low(ctx, x, low, high, *, generator=None, **options):
    return _randint(ctx, low, high, generator)


@registry.register(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(ctx, n, *, generator=None, **options):
    _check_generator(ctx, generator)
    return jax.random.permutation(ctx.rng_key(), n)


def _check_sample_count(probabilities, num_samples, replacement=False, *, generator=None) -> None:
    """The checks of ATen's CPU kernel that need no values (the meta kernel has none)."""
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > probabilities.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")


@registry.register(aten.multinomial.default, random=True, validate=_check_sample_count)
def multinomial(ctx, probabilities, num_samples, replacement=False, *, generator=None):
    """Category indices drawn by (unnormalized) row weights: with replacement, independent
    categorical draws; without, the Gumbel top-k trick, which draws categories one after another
    without putting them back, as ATen's sequential sampler does. Invalid rows (negative or
    non-finite weights, fewer positive weights than samples without replacement), which ATen
    rejects after reading them on the host, are not detected."""
    _check_generator(ctx, generator)
    logits = jnp.log(probabilities.astype(opmath(probabilities.dtype)))
    key = ctx.rng_key()
    if replacement:
        batch = logits.shape[:-1]
        return jax.random.categorical(key, logits[..., None, :], axis=-1, shape=(*batch, num_samples))
    perturbed = logits + jax.random.gumbel(key, logits.shape, logits.dtype)
    return lax.top_k(perturbed, num_samples)[1]


# --- dropout ------------------------------------------------------------------------------------


def _dropout_scale(p: float) -> float:
    return 0.0 if p == 1 else 1.0 / (1.0 - p)


@registry.register(aten.native_dropout.default, random=True)
def native_dropout(ctx, x, p, train):
    """(x * mask / (1 - p), mask) with mask ~ Bernoulli(1 - p); the identity when not training."""
    if train is False:
        return x, jnp.ones(x.shape, bool)
    keep = jax.random.bernoulli(ctx.rng_key(), 1.0 - p, x.shape)
    compute = opmath(x.dtype)
    return x.astype(compute) * keep.astype(compute) * _dropout_scale(p), keep


@registry.register(aten.native_dropout_backward.default)
def native_dropout_backward(ctx, grad_output, mask, scale):
    """grad * (mask * scale), the factor rounded to the gradient's dtype first as in ATen."""
    factor = mask.astype(grad_output.dtype) * jnp.asarray(scale, grad_output.dtype)
    compute = opmath(grad_output.dtype)
    return grad_output.astype(compute) * factor.astype(compute)
