"""Custom kernels (`torchtpu.kernels.jax_kernel`) against PyTorch CPU, in every execution mode.

A plain JAX kernel (backward from `jax.vjp`, a static argument), a Pallas kernel (the fused
matmul + bias + ReLU of `examples.kernels.fused_dense`, custom VJP) and, when Helion is
installed, a Helion kernel (`examples.kernels.helion_bias_relu`, Pallas backend, custom VJP)
each give PyTorch CPU's values and gradients in strict eager mode, DeferAndFuse and
`torch.compile(backend="tpu")` (compiled: inside one graph, no graph break). Kernels whose
outputs break their declaration raise `KernelError` naming the kernel; a kernel that fails to
trace keeps its error, noted with the kernel's name.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import torchtpu
from examples.kernels.fused_dense import fused_dense_relu
from torchtpu.kernels import KernelError, jax_kernel

MODES = ["strict", "defer", "compiled"]
HELION_MISSING = importlib.util.find_spec("helion") is None


@jax_kernel("test_kernels::tanh_mix", backward="vjp")
def tanh_mix(x, y, *, alpha: float = 1.0):
    return x * jnp.tanh(y) + alpha * y


def run(mode: str, fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`fn` on `tpu` copies of `inputs` in `mode`: its output and the gradients of a weighted
    sum of it, on the CPU. Compiled, the kernel must be inside the graph (no graph break)."""
    leaves = [t.to("tpu").requires_grad_() for t in inputs]
    call = torch.compile(fn, backend="tpu") if mode == "compiled" else fn
    torch._dynamo.utils.counters.clear()
    with torchtpu.eager_mode("strict" if mode == "compiled" else mode):
        out = call(*leaves)
        weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)
        (out * weights.to("tpu")).sum().backward()
    if mode == "compiled":
        assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    return out.detach().cpu(), [leaf.grad.cpu() for leaf in leaves]


def reference(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def assert_matches(got, want, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    (out, grads), (want_out, want_grads) = got, want
    torch.testing.assert_close(out, want_out, rtol=rtol, atol=atol)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", MODES)
def test_jax_kernel_with_vjp_backward_matches_torch(mode):
    x, y = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), torch.randn(6, 5)
    got = run(mode, lambda a, b: tanh_mix(a, b, alpha=0.5), x, y)
    assert_matches(got, reference(lambda a, b: a * torch.tanh(b) + 0.5 * b, x, y))


@pytest.mark.parametrize("mode", MODES)
def test_pallas_fused_dense_with_custom_vjp_matches_torch(mode):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(16, 32, generator=g), torch.randn(32, 256, generator=g), torch.randn(256, generator=g)
    got = run(mode, fused_dense_relu, x, w, b)
    want = reference(lambda x, w, b: torch.relu(x @ w + b), x, w, b)
    assert (want[0] > 0).any() and (want[0] == 0).any()
    assert_matches(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_runs_on_cpu_tensors_through_jax():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(tanh_mix(x, y, alpha=2.0), x * torch.tanh(y) + 2.0 * y)


# ----------------------------------------------------------------------------- Helion


@pytest.fixture(scope="module")
def helion_bias_relu():
    if HELION_MISSING:
        pytest.skip("helion is not installed (optional extra: pip install .[helion])")
    from examples.kernels.helion_bias_relu import bias_relu

    return bias_relu


@pytest.mark.parametrize("mode", MODES)
def test_helion_kernel_matches_torch(mode, helion_bias_relu):
    g = torch.Generator().manual_seed(2)
    x, bias = torch.randn(16, 256, generator=g), torch.randn(256, generator=g)
    got = run(mode, helion_bias_relu, x, bias)
    assert_matches(got, reference(lambda a, b: torch.relu(a + b), x, bias))


def test_helion_kernel_of_another_backend_is_rejected_naming_it():
    if HELION_MISSING:
        pytest.skip("helion is not installed (optional extra: pip install .[helion])")
    import helion

    @helion.kernel(backend="triton")
    def copy(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(TypeError, match="kernel test_kernels::triton_copy: .* backend 'triton'"):
        jax_kernel("test_kernels::triton_copy")(copy)


# ----------------------------------------------------------------------------- bad kernels


@jax_kernel("test_kernels::short_rows", out_spec=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
def short_rows(x):
    return x[:-1]


@jax_kernel("test_kernels::int_result", out_spec=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
def int_result(x):
    return x.astype(jnp.int32)


@jax_kernel("test_kernels::two_results")
def two_results(x):
    return x, x


def _mismatched_blocks(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@jax_kernel("test_kernels::pallas_mismatched_blocks")
def pallas_mismatched_blocks(x):
    return pl.pallas_call(
        _mismatched_blocks,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(1,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((16, 128), lambda i: (0, 0)),
    )(x)


BAD_KERNELS = [
    (short_rows, r"kernel test_kernels::short_rows: output 0 is float32\[3, 4\] but its out_spec says float32\[4, 4\]"),
    (int_result, r"kernel test_kernels::int_result: output 0 is int32\[4, 4\] but its out_spec says float32\[4, 4\]"),
    (two_results, r"kernel test_kernels::two_results returned 2 outputs; it was declared with num_outputs=1"),
]


@pytest.mark.parametrize("kernel, message", BAD_KERNELS, ids=[k.name.rpartition(":")[2] for k, _ in BAD_KERNELS])
@pytest.mark.parametrize("mode", MODES)
def test_bad_kernel_raises_naming_the_kernel(mode, kernel, message):
    x = torch.randn(4, 4, device="tpu")
    call = torch.compile(lambda t: kernel(t) * 2, backend="tpu") if mode == "compiled" else kernel
    with torchtpu.eager_mode("strict" if mode == "compiled" else mode):
        with pytest.raises(Exception, match=message) as raised:
            call(x)
    assert KernelError in [type(e) for e in _chain(raised.value)] or mode == "compiled"


def _chain(error: BaseException | None) -> list[BaseException]:
    chain = []
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


@pytest.mark.parametrize("mode", MODES)
def test_kernel_that_fails_to_trace_keeps_its_error_noted_with_the_kernel(mode):
    x = torch.randn(4, 4, device="tpu")
    call = pallas_mismatched_blocks
    if mode == "compiled":
        call = torch.compile(lambda t: pallas_mismatched_blocks(t) * 2, backend="tpu")
    with torchtpu.eager_mode("strict" if mode == "compiled" else mode):
        with pytest.raises(Exception) as raised:
            call(x)
    notes = [note for error in _chain(raised.value) for note in getattr(error, "__notes__", [])]
    assert "in kernel test_kernels::pallas_mismatched_blocks, traced on inputs (float32[4, 4])" in notes


@jax_kernel("test_kernels::momentum_step", num_outputs=2, mutates=("param", "velocity"))
def momentum_step(param, velocity, grad, *, rate: float = 0.1):
    velocity = 0.9 * velocity + grad
    return param - rate * velocity, velocity


def _momentum_reference(param, velocity, grad, rate=0.1):
    velocity = 0.9 * velocity + grad
    return param - rate * velocity, velocity


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_inplace_form_writes_its_outputs_into_the_mutated_inputs_where_they_are(mode):
    """`inplace` updates param and velocity as the functional kernel computes them, in the device
    memory they had (donated: no copy; a fused program may swap two buffers of one shape), and
    leaves the other input alone."""
    from torchtpu import storage

    cpu = [torch.randn(64, 8) for _ in range(3)]
    # Buffers a program made: on the CPU platform a transfer from the host may alias host memory,
    # which donation copies instead of reusing.
    param, velocity, grad = (t.to("tpu") * 1 for t in cpu)
    view = param[2:5]

    def addresses() -> set[int]:
        torch.tpu.synchronize()
        return {storage.buffer_of(t).value.unsafe_buffer_pointer() for t in (param, velocity)}

    with torchtpu.eager_mode(mode):
        before = addresses()
        assert momentum_step.inplace(param, velocity, grad, rate=0.5) is None
        assert addresses() == before
    want_param, want_velocity = _momentum_reference(*cpu, rate=0.5)
    torch.testing.assert_close(param.cpu(), want_param, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(velocity.cpu(), want_velocity, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(view.cpu(), want_param[2:5], rtol=1e-6, atol=1e-6)
    assert torch.equal(grad.cpu(), cpu[2])


def test_inplace_form_on_cpu_tensors_and_its_errors():
    cpu = [torch.randn(16) for _ in range(3)]
    param, velocity = cpu[0].clone(), cpu[1].clone()
    momentum_step.inplace(param, velocity, cpu[2])
    want_param, want_velocity = _momentum_reference(*cpu)
    torch.testing.assert_close(param, want_param)
    torch.testing.assert_close(velocity, want_velocity)
    with pytest.raises(TypeError, match="kernel test_kernels::tanh_mix declares no mutated inputs"):
        tanh_mix.inplace(*cpu[:2])
    with pytest.raises(ValueError, match=r"mutates=\('x', 'z'\) must name 2 distinct tensor parameters"):
        jax_kernel("test_kernels::bad_mutates", num_outputs=2, mutates=("x", "z"))(lambda x, y: (x, y))
