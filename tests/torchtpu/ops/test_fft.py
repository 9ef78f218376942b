"""`torch.fft` on `tpu` against PyTorch's CPU FFTs (pocketfft): every transform family through
ATen's three primitives (`_fft_r2c`, `_fft_c2r`, `_fft_c2c`), with signal sizes that pad and trim,
each normalisation, several dims, float64, the short-time transforms, and gradients."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchtpu

from cpu_reference import grads_same_as_cpu, strict_ops  # noqa: F401

_g = torch.Generator().manual_seed(0)
REAL = torch.randn(6, 10, generator=_g)
COMPLEX = torch.randn(6, 10, dtype=torch.complex64, generator=_g)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def close_to_cpu(fn, x, **tolerance):
    torch.testing.assert_close(fn(x.to("tpu")).cpu(), fn(x), **(tolerance or TOLERANCE))


TRANSFORMS = {
    "fft": lambda x: torch.fft.fft(x),
    "fft_n_pad": lambda x: torch.fft.fft(x, n=16, dim=0),
    "ifft_n_trim_ortho": lambda x: torch.fft.ifft(x, n=7, norm="ortho"),
    "fft2_forward": lambda x: torch.fft.fft2(x, norm="forward"),
    "ifftn_s": lambda x: torch.fft.ifftn(x, s=(4, 12)),
    "rfft": lambda x: torch.fft.rfft(x.real if x.is_complex() else x),
    "rfftn_dim0": lambda x: torch.fft.rfftn(x.real if x.is_complex() else x, dim=(0,), norm="ortho"),
    "irfft": lambda x: torch.fft.irfft(x),
    "irfft_n_odd": lambda x: torch.fft.irfft(x, n=9, dim=0),
    "irfft2_s": lambda x: torch.fft.irfft2(x, s=(5, 8), norm="forward"),
    "hfft": lambda x: torch.fft.hfft(x, n=12),
    "ihfft": lambda x: torch.fft.ihfft(x.real if x.is_complex() else x),
    "ihfftn": lambda x: torch.fft.ihfftn(x.real if x.is_complex() else x),
    "fftshift_roundtrip": lambda x: torch.fft.ifftshift(torch.fft.fftshift(torch.fft.fft(x), dim=1), dim=1),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transforms_of_complex_input(name):
    close_to_cpu(TRANSFORMS[name], COMPLEX)


@pytest.mark.parametrize("name", ["fft", "rfft", "fft2_forward", "ihfft", "rfftn_dim0"])
def test_transforms_of_real_input(name):
    close_to_cpu(TRANSFORMS[name], REAL)


def test_float64_keeps_double_precision():
    x = REAL.double()
    close_to_cpu(lambda v: torch.fft.irfft(torch.fft.rfft(v) * 1j, n=10), x, rtol=1e-12, atol=1e-12)
    close_to_cpu(lambda v: torch.fft.fftn(v.to(torch.complex128)), x, rtol=1e-12, atol=1e-12)


def test_stft_and_istft():
    signal = torch.randn(2, 200, generator=_g)
    window = torch.hann_window(32)

    def stft(x):
        return torch.stft(x, 32, hop_length=8, window=window.to(x.device), return_complex=True)

    close_to_cpu(stft, signal)
    spectrum = stft(signal)
    close_to_cpu(lambda s: torch.istft(s, 32, hop_length=8, window=window.to(s.device), length=200), spectrum)


@pytest.mark.parametrize("transform", [
    lambda x: torch.fft.rfft(x).abs(),
    lambda x: torch.fft.irfft(torch.fft.rfft(x) * torch.linspace(0, 1, 6, device=x.device), n=10),
    lambda x: torch.view_as_real(torch.fft.fft2(x.to(torch.complex64), norm="ortho")),
], ids=["rfft_abs", "filter", "fft2_ortho"])
def test_gradients(transform):
    grads_same_as_cpu(transform, REAL)


@pytest.mark.parametrize("dtype", [None, torch.float64, torch.bfloat16, torch.float16])
def test_sample_frequencies_equal_cpu_and_compile_into_the_program(dtype):
    """`fftfreq` / `rfftfreq` bit for bit against CPU (odd and even lengths, a spacing), and
    inside `torch.compile(backend="tpu")` without splitting the graph (they did: PyTorch's
    composite is kept whole in graphs)."""
    for n in (1, 2, 7, 8):
        for freq in (torch.fft.fftfreq, torch.fft.rfftfreq):
            expected = freq(n, 0.3, dtype=dtype)
            got = freq(n, 0.3, dtype=dtype, device="tpu")
            assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        compiled = torch.compile(
            lambda x: x * torch.fft.fftfreq(5, device=x.device) + torch.fft.rfftfreq(8, device=x.device)[:5],
            backend="tpu")
        x = torch.arange(5.0)
        torch.testing.assert_close(compiled(x.to("tpu")).cpu(), x * torch.fft.fftfreq(5) + torch.fft.rfftfreq(8)[:5])
    assert "compiled_graphs_split" not in torchtpu.metrics()

