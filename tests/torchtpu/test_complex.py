"""Complex tensors on `tpu` against PyTorch's CPU kernels: storage and host copies, the views that
reinterpret a complex buffer as float pairs (aliasing one storage, as on CPU), PyTorch's lazy
conjugate and negative bits, the complex-capable lowerings (values and gradients), and the clear
error an op without complex support raises."""

from __future__ import annotations

import pytest
import torch

import torchtpu
from torchtpu.ops.registry import ComplexNotSupported

_g = torch.Generator().manual_seed(0)
A = torch.randn(4, 5, dtype=torch.complex64, generator=_g)
B = torch.randn(4, 5, dtype=torch.complex64, generator=_g)
M = torch.randn(5, 3, dtype=torch.complex64, generator=_g)


@pytest.fixture(autouse=True)
def strict_ops(monkeypatch):
    """A CPU fallback would hide a missing complex lowering."""
    monkeypatch.setenv("TORCHTPU_STRICT_OPS", "1")


@pytest.fixture(params=["strict", "defer"])
def mode(request):
    with torchtpu.eager_mode(request.param):
        yield request.param


def same_as_cpu(fn, *args, exact=False):
    expected = fn(*args)
    actual = fn(*(a.to("tpu") for a in args))
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual.cpu(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_host_round_trip_and_printing(dtype):
    x = A.to(dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and t.device.type == "tpu"
    assert torch.equal(t.cpu(), x)
    assert t[1, 2].item() == x[1, 2].item()
    assert t.tolist() == x.tolist()


def test_printing():
    assert repr(A[:2, :2].to("tpu")) == repr(A[:2, :2]).replace(")", ", device='tpu:0')")


def test_complex32_is_refused():
    with pytest.raises(TypeError, match="complex32 is not supported on the tpu device"):
        torch.zeros(2, dtype=torch.complex32).to("tpu")


def test_view_as_real_aliases_the_complex_storage(mode):
    def fn(x):
        x = x.clone()
        real = torch.view_as_real(x)
        real[1, 2, 0] = 100.0          # the real part of x[1, 2]
        real[:, 0, 1].mul_(-1)         # the imaginary parts of column 0
        return x
    same_as_cpu(fn, A, exact=True)


def test_view_as_complex_and_dtype_views_alias(mode):
    def fn(x):
        pairs = torch.view_as_real(x.clone()).contiguous()
        z = torch.view_as_complex(pairs)
        z[0].mul_(2j)
        flat = z.view(torch.float32)   # (4, 10): interleaved real and imaginary parts
        flat[:, 1::2].add_(1)
        return torch.stack([pairs.flatten(), flat.flatten()])
    same_as_cpu(fn, A, exact=True)


def test_real_imag_views_write_through(mode):
    def fn(x):
        x = x.clone()
        x.real[0].fill_(7)
        x.imag[:, 1].add_(3)
        return x
    same_as_cpu(fn, A, exact=True)


def test_conjugate_and_negative_bits(mode):
    t = A.to("tpu")
    lazy = t.conj()
    assert lazy.is_conj()
    assert torch.equal(lazy.cpu(), A.conj())
    assert torch.equal(lazy.imag.cpu(), A.conj().imag)          # the imaginary part of a conj: neg bit
    assert torch.equal(torch.conj_physical(t).cpu(), A.conj())
    assert torch.equal(lazy.resolve_conj().cpu(), A.conj())

    def write_through_conj(x):
        x = x.clone()
        x.conj().imag.add_(1.0)        # conj's imaginary part is -imag: x.imag falls by 1
        x.conj()[2].mul_(1j)
        return x
    same_as_cpu(write_through_conj, A, exact=True)


ELEMENTWISE = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - 2 * b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "pow": lambda a, b: a ** b, "exp": lambda a, b: torch.exp(a),
    "log": lambda a, b: torch.log(a), "sqrt": lambda a, b: torch.sqrt(a), "sin": lambda a, b: torch.sin(a),
    "tanh": lambda a, b: torch.tanh(a), "sigmoid": lambda a, b: torch.sigmoid(a),
    "reciprocal": lambda a, b: a.reciprocal(), "abs": lambda a, b: a.abs(), "angle": lambda a, b: a.angle(),
    "sgn": lambda a, b: a.sgn(), "conj_mul": lambda a, b: a.conj() * b,
    "polar": lambda a, b: torch.polar(a.abs(), b.angle()), "complex": lambda a, b: torch.complex(a.real, b.imag),
    "eq": lambda a, b: torch.eq(a, a * (b.real > 0)), "where": lambda a, b: torch.where(a.real > 0, a, b),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise(name):
    same_as_cpu(ELEMENTWISE[name], A, B)


REDUCTIONS_AND_MATMULS = {
    "sum": lambda a: a.sum(1), "mean": lambda a: a.mean(), "prod": lambda a: a.prod(0),
    "cumsum": lambda a: a.cumsum(1), "mm": lambda a: a @ M.to(a.device),
    "mm_conj": lambda a: a.conj() @ M.to(a.device), "bmm": lambda a: torch.bmm(a[None], a.mT[None]),
    "cat_flip": lambda a: torch.cat([a, a.flip(0)]), "gather": lambda a: a.gather(1, torch.tensor([[0, 4]] * 4, device=a.device)),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS_AND_MATMULS))
def test_reductions_and_matmuls(name):
    with torch.tpu.precision("highest"):
        same_as_cpu(REDUCTIONS_AND_MATMULS[name], A)


def test_gradient_through_complex_ops_matches_cpu():
    def loss_grads(device):
        x = torch.linspace(-1, 2, 20).reshape(4, 5).to(device).requires_grad_()
        y = torch.linspace(0.5, 1, 20).reshape(4, 5).to(device).requires_grad_()
        z = torch.complex(x, y)
        loss = ((z * z.conj().exp()).abs() + (z @ z.mT).real.sum()).sum()
        return [g.cpu() for g in torch.autograd.grad(loss, (x, y))]

    with torch.tpu.precision("highest"):
        torch.testing.assert_close(loss_grads("tpu"), loss_grads("cpu"), rtol=1e-5, atol=1e-5)


def test_complex_tensors_built_inside_a_compiled_graph():
    """`torch.complex` and `torch.polar` are lowered: a compiled graph building complex tensors
    from real ones runs as one program, values and gradients as on CPU."""
    import warnings

    def fn(x, y):
        z = torch.complex(x, y) * torch.polar(y.abs() + 1, x)
        return torch.view_as_real(torch.fft.fft(z)).sum(-1)

    x, y = torch.randn(8), torch.randn(8)
    torch._dynamo.reset()
    torchtpu.reset_metrics()
    xt, yt = x.to("tpu").requires_grad_(), y.to("tpu").requires_grad_()
    xc, yc = x.clone().requires_grad_(), y.clone().requires_grad_()
    with torch.tpu.precision("highest"), warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        out = torch.compile(fn, backend="tpu")(xt, yt)
        out.sum().backward()
    expected = fn(xc, yc)
    expected.sum().backward()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close([xt.grad.cpu(), yt.grad.cpu()], [xc.grad, yc.grad], rtol=1e-5, atol=1e-5)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_complex_randn_is_seeded_and_standard():
    torch.tpu.manual_seed(3)
    first = torch.randn(4096, dtype=torch.complex64, device="tpu").cpu()
    torch.tpu.manual_seed(3)
    assert torch.equal(torch.randn(4096, dtype=torch.complex64, device="tpu").cpu(), first)
    # PyTorch's complex normal: each part has variance 1/2, so E|z|^2 = 1.
    assert abs(first.real.var().item() - 0.5) < 0.05 and abs(first.imag.var().item() - 0.5) < 0.05


def test_an_op_without_complex_support_names_itself():
    with pytest.raises(ComplexNotSupported, match=r"aten\.sort\.default does not support torch\.complex64"):
        torch.sort(A.to("tpu"))
    with pytest.raises(ComplexNotSupported, match=r"aten\.maximum\.default does not support"):
        torch.maximum(A.to("tpu"), B.to("tpu"))
