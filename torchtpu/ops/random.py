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

from torchtpu import dtypes
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


# The rational correction of ATen's `dirichlet_grad_one` (Distributions.h): coefficients indexed
# [numerator or denominator][power of u][power of a][power of b].
_DIRICHLET_RATIONAL = np.array([
    [[[1.003668233, -0.01061107488, -0.0657888334, 0.01201642863],
      [0.6336835991, -0.3557432599, 0.05486251648, -0.001465281033],
      [-0.03276231906, 0.004474107445, 0.002429354597, -0.0001557569013]],
     [[0.221950385, -0.3187676331, 0.01799915743, 0.01074823814],
      [-0.2951249643, 0.06219954479, 0.01535556598, 0.001550077057],
      [0.02155310298, 0.004170831599, 0.001292462449, 6.976601077e-05]],
     [[-0.05980841433, 0.008441916499, 0.01085618172, 0.002319392565],
      [0.02911413504, 0.01400243777, -0.002721828457, 0.000751041181],
      [0.005900514878, -0.001936558688, -9.495446725e-06, 5.385558597e-05]]],
    [[[1, -0.02924021934, -0.04438342661, 0.007285809825],
      [0.6357567472, -0.3473456711, 0.05454656494, -0.002407477521],
      [-0.03301322327, 0.004845219414, 0.00231480583, -0.0002307248149]],
     [[0.5925320577, -0.1757678135, 0.01505928619, 0.000564515273],
      [0.1014815858, -0.06589186703, 0.01272886114, -0.0007316646956],
      [-0.007258481865, 0.001096195486, 0.0003934994223, -4.12701925e-05]],
     [[0.06469649321, -0.0236701437, 0.002902096474, -5.896963079e-05],
      [0.001925008108, -0.002869809258, 0.0008000589141, -6.063713228e-05],
      [-0.0003477407336, 6.959756487e-05, 1.097287507e-05, -1.650964693e-06]]],
])


def _beta_grad_alpha_small(x, alpha, beta):
    """d x / d alpha of a Beta(alpha, beta) sample `x` near 0: a Taylor series (ATen's)."""
    factor = lax.digamma(alpha) - lax.digamma(alpha + beta) - jnp.log(x)
    numer = jnp.ones_like(x)
    series = numer / alpha * (factor + 1 / alpha)
    for i in range(1, 11):
        numer = numer * (i - beta) * x / i
        series = series + numer / (alpha + i) * (factor + 1 / (alpha + i))
    result = x * (1 - x) ** -beta * series
    return jnp.where(jnp.isnan(result), 0, result)


def _beta_grad_beta_small(x, alpha, beta):
    """d x / d beta of a Beta(alpha, beta) sample `x` near 0: a Taylor series (ATen's)."""
    factor = lax.digamma(alpha + beta) - lax.digamma(beta)
    numer, betas, dbetas, series = jnp.ones_like(x), jnp.ones_like(x), jnp.zeros_like(x), factor / alpha
    for i in range(1, 9):
        numer = numer * -x / i
        dbetas = dbetas * (beta - i) + betas
        betas = betas * (beta - i)
        series = series + numer / (alpha + i) * (dbetas + factor * betas)
    result = -((1 - x) ** (1 - beta)) * series
    return jnp.where(jnp.isnan(result), 0, result)


def _beta_grad_alpha_mid(x, alpha, beta):
    """d x / d alpha of a Beta(alpha, beta) sample `x` for large alpha and beta: Rice's saddle
    point expansion (ATen's), a polynomial near the mean, where the expansion is singular."""
    total = alpha + beta
    mean = alpha / total
    std = jnp.sqrt(alpha * beta / (total + 1)) / total
    poly = 47 * x * beta**4 + alpha * (
        (43 + 20 * (16 + 27 * beta) * x) * beta**3 + alpha * (
            3 * (59 + 180 * beta - 90 * x) * beta**2 + alpha * (
                (453 + 1620 * beta * (1 - x) - 455 * x) * beta + alpha * (8 * (1 - x) * (135 * beta - 11)))))
    near_mean = (1 + 12 * alpha) * (1 + 12 * beta) / (total * total) / (1 - x) * poly / (
        12960 * alpha**3 * beta**2 * (1 + 12 * total))
    prefactor = -x / jnp.sqrt(2 * alpha * beta / total)
    stirling = ((1 + 1 / (12 * alpha) + 1 / (288 * alpha * alpha)) * (1 + 1 / (12 * beta) + 1 / (288 * beta * beta))
                / (1 + 1 / (12 * total) + 1 / (288 * total * total)))
    axbx = alpha * (x - 1) + beta * x
    term1 = (2 * alpha**2 * (x - 1) + alpha * beta * (x - 1) - x * beta**2) / (
        jnp.sqrt(2 * alpha / beta) * total**1.5 * axbx * axbx)
    term2 = 0.5 * jnp.log(alpha / (total * x))
    term3 = jnp.sqrt(8 * alpha * beta / total) / (beta * x + alpha * (x - 1))
    term4 = (beta * jnp.log(beta / (total * (1 - x))) + alpha * jnp.log(alpha / (total * x))) ** -1.5
    expansion = stirling * prefactor * (term1 + term2 * (term3 + jnp.where(x < mean, term4, -term4)))
    return jnp.where((mean - 0.1 * std <= x) & (x <= mean + 0.1 * std), near_mean, expansion)


def _beta_grad_alpha_rational(x, alpha, total):
    """d x / d alpha of a Beta(alpha, total - alpha) sample `x`: a rational correction to an
    analytic approximation (ATen's)."""
    u = jnp.log(x)
    a = jnp.log(alpha) - u
    b = jnp.log(total) - a
    p, q = jnp.zeros_like(x), jnp.zeros_like(x)
    for i in range(3):
        for j in range(3):
            ua = u**i * a**j
            cp, cq = _DIRICHLET_RATIONAL[0, i, j], _DIRICHLET_RATIONAL[1, i, j]
            p = p + ua * (cp[0] + b * (cp[1] + b * (cp[2] + b * cp[3])))
            q = q + ua * (cq[0] + b * (cq[1] + b * (cq[2] + b * cq[3])))
    return p / q * x * (lax.digamma(total) - lax.digamma(alpha)) / (total - alpha)


def _dirichlet_grad_meta(x: torch.Tensor, alpha: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """ATen's CPU kernel: float and double only, the arguments broadcast together."""
    if x.dtype not in (torch.float32, torch.float64):
        raise NotImplementedError(f'"_dirichlet_grad_cpu" not implemented for \'{dtypes.aten_name(x.dtype)}\'')
    return torch.empty(torch.broadcast_shapes(x.shape, alpha.shape, total.shape), dtype=x.dtype, device="meta")


@registry.register(aten._dirichlet_grad.default, meta=_dirichlet_grad_meta)
def dirichlet_grad(ctx, x, alpha, total):
    """d x / d alpha of each component `x` of a Dirichlet sample, as a Beta(alpha, total - alpha)
    sample (`Dirichlet.rsample`'s and `Beta.rsample`'s backward): ATen's four approximations,
    chosen by its regions of (x, alpha, total). The saddle point expansion and the rational
    correction cancel heavily: as ATen's CPU kernel, they run in float64 (in float32 they were
    off by up to 2.5%)."""
    x, alpha, total = jnp.broadcast_arrays(x, alpha, total)
    wide = [v.astype(jnp.float64) for v in (x, alpha, total)]
    beta = total - alpha
    boundary = total * x * (1 - x)
    return jnp.select(
        [(x <= 0.5) & (boundary < 2.5), (x >= 0.5) & (boundary < 0.75), (alpha > 6) & (beta > 6)],
        [_beta_grad_alpha_small(x, alpha, beta), -_beta_grad_beta_small(1 - x, beta, alpha),
         _beta_grad_alpha_mid(wide[0], wide[1], wide[2] - wide[1]).astype(x.dtype)],
        _beta_grad_alpha_rational(*wide).astype(x.dtype))


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
