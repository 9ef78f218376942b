"""Random ops on `tpu`: samples tested against the distributions' reference CDFs and PMFs
(SciPy), supports and dtypes, seeding (`torch.manual_seed`, `torch.tpu.get_rng_state` /
`set_rng_state`), dropout masks and their backward against CPU, and no recompilation per draw.

Streams are fixed by seeding, so every statistical test here is deterministic; its threshold
(p > 1e-3) is the chance a correct sampler would fail it with an unlucky seed.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from scipy import stats

import torchtpu
from test_reduction import strict_ops  # noqa: F401  (the autouse fixture)

N = 20_000
P_MIN = 1e-3


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)


def _host(x: torch.Tensor) -> np.ndarray:
    assert x.device.type == "tpu"
    return x.cpu().double().numpy().reshape(-1)


def _empty(n: int = N, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device="tpu")


CONTINUOUS = {
    "rand": (lambda: torch.rand(N, device="tpu"), stats.uniform()),
    "uniform_": (lambda: _empty().uniform_(-2, 3), stats.uniform(-2, 5)),
    "randn": (lambda: torch.randn(N, device="tpu"), stats.norm()),
    "randn_like": (lambda: torch.randn_like(_empty(dtype=torch.float64)), stats.norm()),
    "rand_like_bf16": (lambda: torch.rand_like(_empty(dtype=torch.bfloat16)), stats.uniform()),
    "normal_float_float": (lambda: torch.normal(2.0, 3.0, (N,), device="tpu"), stats.norm(2, 3)),
    "normal_tensor_float": (lambda: torch.normal(torch.full((N,), -1.0, device="tpu"), 0.5), stats.norm(-1, 0.5)),
    "normal_float_tensor": (lambda: torch.normal(1.0, torch.full((N,), 2.0, device="tpu")), stats.norm(1, 2)),
    "exponential_": (lambda: _empty().exponential_(2.0), stats.expon(scale=0.5)),
    "cauchy_": (lambda: _empty().cauchy_(1.0, 2.0), stats.cauchy(1, 2)),
    "log_normal_": (lambda: _empty().log_normal_(0.5, 0.25), stats.lognorm(s=0.25, scale=math.exp(0.5))),
    "standard_gamma": (lambda: torch._standard_gamma(torch.full((N,), 2.5, device="tpu")), stats.gamma(2.5)),
    "standard_gamma_small": (lambda: torch._standard_gamma(torch.full((N,), 0.3, device="tpu")), stats.gamma(0.3)),
    # Dirichlet(1, 2, 3)'s first coordinate is Beta(1, 5); `Beta` samples through `_sample_dirichlet`.
    "sample_dirichlet_marginal": (lambda: torch._sample_dirichlet(torch.tensor([1.0, 2.0, 3.0], device="tpu")
                                                                  .expand(N, 3).contiguous())[:, 0], stats.beta(1, 5)),
    "beta": (lambda: torch.distributions.Beta(torch.full((N,), 2.0, device="tpu"), torch.full((N,), 3.0, device="tpu"))
             .sample(), stats.beta(2, 3)),
}


@pytest.mark.parametrize("name", sorted(CONTINUOUS))
def test_continuous_distribution(name):
    draw, reference = CONTINUOUS[name]
    samples = _host(draw())
    assert np.isfinite(samples).all()
    assert stats.kstest(samples, reference.cdf).pvalue > P_MIN


def test_dirichlet_samples_lie_on_the_simplex():
    samples = torch._sample_dirichlet(torch.tensor([[0.2, 1.0, 5.0], [3.0, 3.0, 3.0]], device="tpu").repeat(500, 1))
    host = samples.cpu()
    assert (host > 0).all()
    torch.testing.assert_close(host.sum(-1), torch.ones(1000))


def test_standard_gamma_grad_against_its_definition():
    """`Gamma.rsample`'s backward: d sample / d alpha at a fixed quantile, -dF/dalpha / pdf, with
    SciPy's regularized incomplete gamma function in float64 (PyTorch's CPU approximation is off
    by up to ~3e-4 relative here; the definition is the reference)."""
    from scipy import special

    alpha = np.repeat([0.3, 0.5, 2.0, 7.0, 40.0], 200)
    sample = stats.gamma(alpha).rvs(random_state=np.random.default_rng(0))
    h = 1e-6
    expected = -(special.gammainc(alpha + h, sample) - special.gammainc(alpha - h, sample)) / (2 * h)
    expected /= stats.gamma(alpha).pdf(sample)
    got = torch._standard_gamma_grad(torch.tensor(alpha, dtype=torch.float32, device="tpu"),
                                     torch.tensor(sample, dtype=torch.float32, device="tpu")).cpu().double().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    alpha = torch.tensor(2.0, device="tpu", requires_grad=True)
    torch.distributions.Gamma(alpha, torch.tensor(1.0, device="tpu")).rsample((8,)).sum().backward()
    assert torch.isfinite(alpha.grad).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dirichlet_grad_matches_pytorchs_cpu_kernel(dtype):
    """`Dirichlet.rsample`'s and `Beta.rsample`'s backward, over all four of ATen's regions (x
    near 0 or 1, both concentrations large, the rest): PyTorch's CPU kernel, to float64's
    rounding and within 2e-5 in float32 (the kernel's two cancelling approximations run in
    float64 on both)."""
    g = torch.Generator().manual_seed(0)
    alpha = torch.cat([torch.rand(200, generator=g) * 0.5 + 0.05, torch.rand(200, generator=g) * 5 + 0.5,
                       torch.rand(200, generator=g) * 40 + 6.5]).to(dtype)
    beta = torch.cat([torch.rand(300, generator=g) * 3 + 0.1, torch.rand(300, generator=g) * 30 + 6.5]).to(dtype)
    x = torch.distributions.Beta(alpha, beta).sample().clamp(1e-6, 1 - 1e-6)
    expected = torch._dirichlet_grad(x, alpha, alpha + beta)
    got = torch._dirichlet_grad(x.to("tpu"), alpha.to("tpu"), (alpha + beta).to("tpu"))
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(got.cpu(), expected, **tolerance)
    with pytest.raises(NotImplementedError, match="not implemented for 'BFloat16'"):
        torch._dirichlet_grad(*(t.to("tpu", torch.bfloat16) for t in (x, alpha, alpha + beta)))


def test_beta_rsample_differentiates_on_the_device():
    """The concentrations' gradient of a tpu `Beta.rsample` is PyTorch's backward of the same
    sample on CPU (a Beta sample is the first component of a Dirichlet one)."""
    from torch.distributions.dirichlet import _Dirichlet_backward

    concentration = torch.tensor([[0.4, 2.0], [3.0, 9.0], [12.0, 8.0]])
    leaf = concentration.to("tpu").requires_grad_()
    sample = torch.distributions.Beta(leaf[:, 0], leaf[:, 1]).rsample((50,))
    cotangent = torch.linspace(-1, 1, sample.numel()).view(sample.shape)
    (sample * cotangent.to("tpu")).sum().backward()
    x = sample.detach().cpu()
    pair = torch.stack([x, 1 - x], -1)
    first_only = torch.stack([cotangent, torch.zeros_like(cotangent)], -1)
    grad = _Dirichlet_backward(pair, concentration.expand(50, 3, 2), first_only)
    torch.testing.assert_close(leaf.grad.cpu(), grad.sum(0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_uniform_interval_stays_half_open(dtype):
    samples = torch.rand(10 * N, dtype=dtype, device="tpu").cpu()
    assert samples.dtype == dtype and samples.min() >= 0 and samples.max() < 1
    shifted = torch.empty(10 * N, dtype=dtype, device="tpu").uniform_(-3, 5).cpu()
    assert shifted.min() >= -3 and shifted.max() < 5


def test_normal_with_tensor_mean_and_std_broadcasts_elementwise():
    mean = torch.linspace(-5, 5, N).reshape(100, 200)
    std = torch.linspace(0.5, 3, 200)
    samples = torch.normal(mean.to("tpu"), std.to("tpu"))
    assert samples.shape == (100, 200)
    standardized = (samples.cpu() - mean) / std
    assert stats.kstest(standardized.double().numpy().reshape(-1), stats.norm().cdf).pvalue > P_MIN


def _chisquare(values: np.ndarray, pmf: dict[int, float]) -> float:
    """p-value of `values` against `pmf` (outcomes with little mass pooled into one cell)."""
    outcomes = sorted(pmf)
    observed = np.array([(values == k).sum() for k in outcomes] + [(~np.isin(values, outcomes)).sum()])
    expected = np.array([pmf[k] for k in outcomes] + [max(1 - sum(pmf.values()), 0)]) * len(values)
    keep = expected > 0
    assert observed[~keep].sum() == 0, f"values outside the support: {np.unique(values[~np.isin(values, outcomes)])}"
    return stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue


def _compiled_randint():
    """`torch.randint` and `randint_like` drawn inside one compiled graph (no graph split)."""
    import warnings

    import torchtpu

    torchtpu.reset_metrics()
    draw = torch.compile(lambda x: torch.cat([torch.randint(-1, 5, (N // 2,), device=x.device),
                                             torch.randint_like(x, -1, 5)]), backend="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        values = draw(_empty(N // 2, dtype=torch.int64))
    assert "compiled_graphs_split" not in torchtpu.metrics()
    return values


DISCRETE = {
    "geometric_": (lambda: _empty().geometric_(0.3), {k: stats.geom(0.3).pmf(k) for k in range(1, 25)}),
    "geometric_int64": (lambda: _empty(dtype=torch.int64).geometric_(0.5), {k: 0.5**k for k in range(1, 20)}),
    "poisson": (lambda: torch.poisson(torch.full((N,), 4.0, device="tpu")), {k: stats.poisson(4).pmf(k) for k in range(20)}),
    "bernoulli_tensor": (lambda: torch.bernoulli(torch.full((N,), 0.3, device="tpu")), {0: 0.7, 1: 0.3}),
    "bernoulli_inplace_tensor_p": (lambda: _empty().bernoulli_(torch.tensor(0.2, device="tpu")), {0: 0.8, 1: 0.2}),
    "bernoulli_p": (lambda: torch.ops.aten.bernoulli.p(_empty(), 0.6), {0: 0.4, 1: 0.6}),
    "binomial": (lambda: torch.binomial(torch.full((N,), 10.0, device="tpu"), torch.full((N,), 0.3, device="tpu")),
                 {k: stats.binom(10, 0.3).pmf(k) for k in range(11)}),
    "random_to": (lambda: _empty().random_(10), {k: 0.1 for k in range(10)}),
    "random_from_to": (lambda: _empty(dtype=torch.int32).random_(-3, 4), {k: 1 / 7 for k in range(-3, 4)}),
    "randint": (lambda: torch.randint(3, 7, (N,), device="tpu"), {k: 0.25 for k in range(3, 7)}),
    "randint_like": (lambda: torch.randint_like(_empty(dtype=torch.int16), 5), {k: 0.2 for k in range(5)}),
    "randint_like_low": (lambda: torch.randint_like(_empty(), -2, 3), {k: 0.2 for k in range(-2, 3)}),
    # Inside a compiled graph the ops themselves are lowered (eager runs PyTorch's random_ composite).
    "randint_compiled": (lambda: _compiled_randint(), {k: 1 / 6 for k in range(-1, 5)}),
    "random_bool": (lambda: _empty(dtype=torch.bool).random_(), {0: 0.5, 1: 0.5}),
    "random_uint8": (lambda: _empty(dtype=torch.uint8).random_(), {k: 1 / 256 for k in range(256)}),
    "random_bf16": (lambda: _empty(dtype=torch.bfloat16).random_(), {k: 1 / 257 for k in range(257)}),
}


@pytest.mark.parametrize("name", sorted(DISCRETE))
def test_discrete_distribution(name):
    draw, pmf = DISCRETE[name]
    assert _chisquare(_host(draw()), pmf) > P_MIN


@pytest.mark.parametrize("dtype, low, high", [
    (torch.int64, 0, 2**63 - 1), (torch.int32, 0, 2**31 - 1), (torch.int8, 0, 127),
    (torch.float32, 0, 2**24), (torch.float64, 0, 2**53),
])
def test_random_without_bounds_covers_the_dtype_range(dtype, low, high):
    values = _empty(dtype=dtype).random_().cpu()
    assert values.min() >= low and values.max() <= high
    assert values.double().mean() == pytest.approx((low + high) / 2, rel=0.05)
    assert torch.equal(values, values.round())


def test_random_bounds_near_the_int64_limits():
    info = torch.iinfo(torch.int64)
    values = _empty(dtype=torch.int64).random_(-5, None).cpu()  # [from, max]
    assert values.min() >= -5 and values.double().mean() == pytest.approx(info.max / 2, rel=0.05)
    full = torch.empty(N, dtype=torch.int64, device="tpu").random_(info.min, None).cpu()  # 64 random bits
    assert (full < 0).double().mean() == pytest.approx(0.5, abs=0.02)
    narrow = torch.empty(N, dtype=torch.int64, device="tpu").random_(info.max - 3, info.max).cpu()
    assert set(narrow.tolist()) == {info.max - 3, info.max - 2, info.max - 1}


def test_randperm_is_a_permutation():
    for n, dtype in ((1, torch.int64), (1000, torch.int64), (300, torch.float32), (0, torch.int32)):
        perm = torch.randperm(n, dtype=dtype, device="tpu").cpu()
        assert perm.dtype == dtype
        assert torch.equal(perm.sort().values, torch.arange(n, dtype=dtype))
    assert not torch.equal(torch.randperm(1000, device="tpu").cpu(), torch.arange(1000))


def test_multinomial_with_replacement_matches_the_weights():
    weights = torch.tensor([[1.0, 0.0, 3.0, 6.0], [5.0, 5.0, 0.0, 0.0]])
    samples = torch.multinomial(weights.to("tpu"), N, replacement=True).cpu()
    assert samples.shape == (2, N) and samples.dtype == torch.int64
    for row, w in zip(samples.numpy(), weights):
        assert _chisquare(row, dict(enumerate((w / w.sum()).tolist()))) > P_MIN


def test_multinomial_without_replacement_draws_distinct_categories():
    weights = torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0])
    samples = torch.multinomial(weights.expand(N, 5).to("tpu"), 3).cpu()
    assert all(len(set(row)) == 3 for row in samples.tolist())
    assert not np.isin(samples.numpy(), [1, 4]).any()
    first = samples[:, 0].numpy()  # the first draw follows the weights themselves
    assert _chisquare(first, {0: 0.1, 2: 0.3, 3: 0.6}) > P_MIN
    single = torch.multinomial(weights.to("tpu"), 2).cpu()
    assert single.shape == (2,)


def test_same_seed_same_stream_and_state_restores_it():
    def draws():
        return [torch.rand(5, device="tpu"), _empty(5).exponential_(), torch.randn(3, device="tpu"),
                torch.randperm(6, device="tpu")]

    torch.manual_seed(7)
    first = [d.cpu() for d in draws()]
    torch.manual_seed(7)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(first, draws()))
    torch.manual_seed(8)
    assert not torch.equal(torch.rand(5, device="tpu").cpu(), first[0])

    state = torch.tpu.get_rng_state()
    draws = [torch.rand(4, device="tpu").cpu() for _ in range(2)]
    assert not torch.equal(draws[0], draws[1])  # every draw advances the stream
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="tpu").cpu(), draws[0])


def test_random_rejects_empty_or_out_of_dtype_ranges():
    with pytest.raises(RuntimeError, match="from=0 >= to=-5"):
        _empty(4, dtype=torch.int64).random_(-5)
    with pytest.raises(RuntimeError, match="out of bounds for torch.int8"):
        _empty(4, dtype=torch.int8).random_(0, 300)
    with pytest.raises(RuntimeError, match="out of bounds for torch.uint8"):
        _empty(4, dtype=torch.uint8).random_(-1, 3)


def test_draws_and_new_parameters_do_not_recompile():
    x = torch.zeros(64, device="tpu")
    x.uniform_(-1.5, 2.5)  # values other than the defaults (0, 1), which the executor keeps static
    torch.rand(64, device="tpu")
    before = torchtpu.metrics().get("eager_programs", 0)
    for low in (2.25, 3.25, 4.25):
        x.uniform_(low, low + 1)
        torch.rand(64, device="tpu")
    assert torchtpu.metrics().get("eager_programs", 0) == before
    assert x.cpu().min() >= 4.25 and x.cpu().max() < 5.25


def test_explicit_cpu_generator_is_refused_with_a_clear_error():
    with pytest.raises(RuntimeError, match="expected a 'tpu' device type for generator but found 'cpu'"):
        torch.rand(3, device="tpu", generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="expected a 'tpu' device type for generator"):
        _empty(3).uniform_(generator=torch.Generator())


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_a_tpu_generator_is_a_stream_of_its_own(mode):
    """`torch.Generator(device="tpu")`: seeded alike, its stream is the device generator's (the
    same (seed, offset) pair); drawing from it leaves the device's generator where it was; its
    state restores its stream; one program serves it and the device's generator."""
    with torchtpu.eager_mode(mode):
        torch.tpu.manual_seed(7)
        expected = [torch.randn(5, device="tpu").cpu(), _empty(4).uniform_(-1.0, 1.0).cpu()]
        device_state = torch.tpu.get_rng_state()
        generator = torch.Generator(device="tpu").manual_seed(7)
        assert generator.device == torch.device("tpu", torch.tpu.current_device())
        drawn = [torch.randn(5, device="tpu", generator=generator).cpu(),
                 _empty(4).uniform_(-1.0, 1.0, generator=generator).cpu()]
        assert all(torch.equal(a, b) for a, b in zip(drawn, expected))
        assert generator.get_offset() == 2 and torch.equal(torch.tpu.get_rng_state(), device_state)
        compiled = "eager_programs" if mode == "strict" else "defer_compiles"
        programs = torchtpu.metrics().get(compiled, 0)
        torch.randn(5, device="tpu", generator=torch.Generator(device="tpu")).cpu()
        assert torchtpu.metrics().get(compiled, 0) == programs  # none compiled per generator
        state = generator.get_state()
        first = torch.rand(3, device="tpu", generator=generator).cpu()
        generator.set_state(state)
        assert torch.equal(torch.rand(3, device="tpu", generator=generator).cpu(), first)
        other = torch.Generator(device="tpu").manual_seed(8)
        assert not torch.equal(torch.rand(3, device="tpu", generator=other).cpu(), first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 1.0])
def test_native_dropout(dtype, p):
    x = torch.linspace(-3, 3, N, dtype=dtype)
    out, mask = torch.native_dropout(x.to("tpu"), p, True)
    out, mask = out.cpu(), mask.cpu()
    assert mask.dtype == torch.bool and out.dtype == dtype
    assert stats.binomtest(int(mask.sum()), N, 1 - p).pvalue > P_MIN
    scale = 0.0 if p == 1 else 1 / (1 - p)
    torch.testing.assert_close(out, (x.float() * mask * scale).to(dtype))
    grad = torch.linspace(1, 2, N, dtype=dtype)
    backward = torch.ops.aten.native_dropout_backward(grad.to("tpu"), mask.to("tpu"), scale).cpu()
    torch.testing.assert_close(backward, torch.ops.aten.native_dropout_backward(grad, mask, scale))


def test_dropout_in_eval_mode_and_through_autograd():
    x = torch.randn(8, 16)
    out, mask = torch.native_dropout(x.to("tpu"), 0.5, False)
    assert torch.equal(out.cpu(), x) and bool(mask.cpu().all())
    leaf = x.to("tpu").requires_grad_()
    y = torch.nn.functional.dropout(leaf, 0.25, training=True)
    y.sum().backward()
    kept = y.detach().cpu() != 0
    torch.testing.assert_close(leaf.grad.cpu(), kept.float() / 0.75)


def test_inplace_overloads_named_unlike_their_functional():
    """`normal_` runs as `normal_functional`, `bernoulli_.float` as `bernoulli.p` (found by
    argument schema): the draws follow the distributions and land in `self`."""
    x = _empty()
    assert x.normal_(1.0, 2.0) is x
    assert stats.kstest(_host(x), stats.norm(1, 2).cdf).pvalue > P_MIN
    y = _empty()
    assert y.bernoulli_(0.25) is y
    ones = _host(y)
    assert set(np.unique(ones)) <= {0.0, 1.0}
    assert stats.binomtest(int(ones.sum()), N, 0.25).pvalue > P_MIN


def test_new_scalar_values_are_checked_after_the_program_is_cached():
    x = _empty(8)
    x.normal_(0.0, 1.0)
    with pytest.raises(RuntimeError, match="std >= 0"):
        x.normal_(0.0, -1.0)
    with pytest.raises(RuntimeError, match="std >= 0"):
        torch.empty(8).normal_(0.0, -1.0)  # the same error as on CPU
    for bad in (lambda t: t.bernoulli_(1.5), lambda t: torch.bernoulli(t, -0.5), lambda t: t.uniform_(2, 1),
                lambda t: torch.multinomial(t.abs(), 0), lambda t: torch.multinomial(t.abs(), 9)):
        with pytest.raises(RuntimeError) as on_cpu:
            bad(torch.rand(8))
        with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value)[:20])):
            bad(x)
