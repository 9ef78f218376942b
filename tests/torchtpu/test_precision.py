"""TPU matmul precision modes: 1, 3 or 6 bf16 passes per float32 contraction.

Two views of the same fact, for matmul, bmm, einsum and convolution:
- accuracy: the relative error against a float64 reference falls in each mode's band
  (bf16 rounding for `default`, about 1e-5 for `high`, float32 for `highest`);
- structure: the compiled program of the call holds 1, 3 or 6 `dot`/`convolution` ops, and
  bf16 inputs always take one pass.
"""

from __future__ import annotations

import re

import jax
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu import dtypes
from torchtpu.exec import eager

aten = torch.ops.aten

PASSES = {"default": 1, "high": 3, "highest": 6}
# Relative Frobenius error of a 512x512 standard-normal product against float64
# (measured: 2.3e-3, 4.4e-6, 1.6e-7; see docs in torchtpu/precision.py).
BANDS = {"default": (1e-3, 5e-3), "high": (1e-6, 2e-5), "highest": (3e-8, 5e-7)}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (torch.linalg.norm(actual.double() - expected) / torch.linalg.norm(expected)).item()


def _lowered(op):
    """The most recent eager program compiled for `op`, lowered from the cached executable with
    its inputs' shapes (the storages' flat buffers)."""
    for key, executable in reversed(list(eager._cache.items())):
        if key[0] is op:
            storages = key[3]
            inputs = [
                jax.ShapeDtypeStruct((storages[i].numel,), dtypes.to_jax(storages[i].dtype))
                for i in executable.program.inputs
            ]
            return executable.jitted.lower(*inputs)
    raise AssertionError(f"no eager program for {op} in the cache")


def _program_text(op) -> str:
    """StableHLO of the most recent eager program compiled for `op`."""
    return _lowered(op).as_text()


def _count(text: str, hlo_op: str) -> int:
    return len(re.findall(rf"stablehlo\.{hlo_op}\b", text))


@pytest.fixture(scope="module")
def normal_512():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(512, 512, generator=gen), torch.randn(512, 512, generator=gen)


@pytest.mark.parametrize("mode", PASSES)
def test_matmul_error_band(mode, normal_512):
    a, b = normal_512
    with torch.tpu.precision(mode):
        actual = (a.to("tpu") @ b.to("tpu")).cpu()
    low, high = BANDS[mode]
    assert low < _relative_error(actual, a.double() @ b.double()) < high


@pytest.mark.parametrize("mode", PASSES)
def test_bmm_error_band(mode, normal_512):
    a, b = normal_512
    a3, b3 = a.reshape(4, 256, 256), b.reshape(4, 256, 256)
    with torch.tpu.precision(mode):
        actual = torch.bmm(a3.to("tpu"), b3.to("tpu")).cpu()
    low, high = BANDS[mode]
    assert low < _relative_error(actual, torch.bmm(a3.double(), b3.double())) < high


@pytest.mark.parametrize("mode", PASSES)
def test_conv_error_band(mode):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 16, 16, generator=gen)
    w = torch.randn(64, 64, 3, 3, generator=gen)
    with torch.tpu.precision(mode):
        actual = torch.nn.functional.conv2d(x.to("tpu"), w.to("tpu"), padding=1).cpu()
    expected = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    low, high = BANDS[mode]
    assert low < _relative_error(actual, expected) < high


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", PASSES)
def test_mm_program_has_one_dot_per_pass(mode, dtype):
    a, b = torch.randn(8, 16, dtype=dtype).to("tpu"), torch.randn(16, 4, dtype=dtype).to("tpu")
    with torch.tpu.precision(mode):
        a @ b
    expected = PASSES[mode] if dtype == torch.float32 else 1
    assert _count(_program_text(aten.mm.default), "dot_general") == expected


@pytest.mark.parametrize("mode", PASSES)
def test_bmm_and_einsum_programs_have_one_dot_per_pass(mode):
    a, b = torch.randn(3, 8, 16).to("tpu"), torch.randn(3, 16, 4).to("tpu")
    with torch.tpu.precision(mode):
        torch.bmm(a, b)
        assert _count(_program_text(aten.bmm.default), "dot_general") == PASSES[mode]
        eager.clear_cache()
        torch.einsum("bij,bjk->bik", a, b)  # einsum decomposes to bmm
        assert _count(_program_text(aten.bmm.default), "dot_general") == PASSES[mode]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", PASSES)
def test_conv_program_has_one_convolution_per_pass(mode, dtype):
    x = torch.randn(2, 3, 8, 8, dtype=dtype).to("tpu")
    w = torch.randn(4, 3, 3, 3, dtype=dtype).to("tpu")
    with torch.tpu.precision(mode):
        torch.nn.functional.conv2d(x, w)
    expected = PASSES[mode] if dtype == torch.float32 else 1
    assert _count(_program_text(aten.convolution.default), "convolution") == expected


def test_conv_backward_programs_take_the_passes():
    x = torch.randn(2, 3, 8, 8).to("tpu").requires_grad_()
    w = torch.randn(4, 3, 3, 3).to("tpu").requires_grad_()
    with torch.tpu.precision("high"):
        torch.nn.functional.conv2d(x, w).sum().backward()
    # grad_input and grad_weight: two convolutions of three passes each.
    assert _count(_program_text(aten.convolution_backward.default), "convolution") == 6


def test_float64_and_integer_products_are_exact():
    a, b = torch.randn(64, 64, dtype=torch.float64), torch.randn(64, 64, dtype=torch.float64)
    with torch.tpu.precision("default"):
        actual = (a.to("tpu") @ b.to("tpu")).cpu()
        assert _count(_program_text(aten.mm.default), "dot_general") == 1
    torch.testing.assert_close(actual, a @ b, rtol=1e-12, atol=1e-12)
    i, j = torch.randint(-2**20, 2**20, (16, 16)), torch.randint(-2**20, 2**20, (16, 16))
    assert torch.equal((i.to("tpu") @ j.to("tpu")).cpu(), i @ j)


def test_precision_setter_and_context_manager():
    original = torch.tpu.precision()
    try:
        torch.tpu.precision("high")
        assert torch.tpu.precision() == "high"
        with torch.tpu.precision("highest"):
            assert torch.tpu.precision() == "highest"
        assert torch.tpu.precision() == "high"
    finally:
        torch.tpu.precision(original)
    assert torch.tpu.precision() == original


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="unknown matmul precision 'fastest'"):
        torch.tpu.precision("fastest")


def test_modes_compile_separately():
    """The mode is part of the compile key: switching it never reuses another mode's program."""
    a, b = torch.randn(8, 8).to("tpu"), torch.randn(8, 8).to("tpu")
    results = {}
    for mode in PASSES:
        with torch.tpu.precision(mode):
            results[mode] = (a @ b).cpu()
    reference = a.cpu().double() @ b.cpu().double()
    errors = [_relative_error(results[m], reference) for m in PASSES]
    assert errors[0] > errors[1] > errors[2]


# Operand layouts of a pass that the native bf16 form rearranges (see precision._row_major_bf16_dot).
DOT_LAYOUTS = {
    "x @ w": ((64, 96), (96, 48), (((1,), (0,)), ((), ()))),
    "x @ w.t()": ((64, 96), (48, 96), (((1,), (1,)), ((), ()))),
    "g.t() @ x": ((96, 64), (96, 48), (((0,), (0,)), ((), ()))),
    "bmm": ((4, 32, 16), (4, 16, 8), (((2,), (1,)), ((0,), (0,)))),
    "bmm, left transposed": ((4, 16, 32), (4, 16, 8), (((1,), (1,)), ((0,), (0,)))),
    "matrix-vector": ((64, 96), (96,), (((1,), (0,)), ((), ()))),
}


@pytest.mark.parametrize("mode", PASSES)
@pytest.mark.parametrize("case", DOT_LAYOUTS)
def test_native_and_widened_bf16_passes_agree(monkeypatch, mode, case):
    """The CPU stand-in's two forms of a pass -- XLA:CPU's native bf16 dot, and the bf16 parts
    widened to fp32 -- compute the same exact products: they agree up to fp32 accumulation
    order in every mode and operand layout, with or without the hint that the right operand is
    a transposed view (a layout hint: right or wrong, the value is the same), and `default`
    equals the float64 product of the bf16-rounded inputs."""
    import numpy as np

    from torchtpu import precision

    lhs, rhs, dims = DOT_LAYOUTS[case]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(lhs, np.float32), rng.standard_normal(rhs, np.float32)
    results = {}
    for native, hint in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(precision, "host_has_bf16_dot", lambda native=native: native)
        product = jax.jit(lambda x, y: precision.dot_general(x, y, dims, mode, "cpu", rhs_transposed=hint))
        results[native, hint] = np.asarray(product(a, b), np.float64)
    scale = np.abs(results[False, False]).max()
    for hint in (False, True):
        np.testing.assert_allclose(results[True, hint], results[False, False], rtol=0, atol=2e-6 * scale)
    if mode == "default":
        rounded = [np.asarray(jax.numpy.asarray(x).astype(jax.numpy.bfloat16), np.float64) for x in (a, b)]
        exact = np.asarray(jax.lax.dot_general(*(jax.numpy.asarray(x, np.float32) for x in rounded), dims,
                                               precision=jax.lax.Precision.HIGHEST), np.float64)
        np.testing.assert_allclose(results[True, False], exact, rtol=0, atol=2e-6 * scale)


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """Element types of the two operands of every `dot` in an optimized HLO module."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    return [(types[x], types[y]) for x, y in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)]


@pytest.mark.skipif(not __import__("torchtpu.precision").precision.host_has_bf16_dot(),
                    reason="this host's CPU has no native bf16 dot: passes are widened to fp32")
@pytest.mark.parametrize("case", ["x @ w.t()", "g.t() @ x", "bmm, left transposed"])
def test_transposed_operands_keep_the_native_bf16_dot(case):
    """XLA:CPU widens a bf16 dot to fp32 (a third of the speed) when an operand arrives
    transposed; the native form copies it row-major instead, so every dot reads bf16."""
    import numpy as np

    from torchtpu import precision

    lhs, rhs, dims = DOT_LAYOUTS[case]
    # The operands as a lowering sees them: produced by a transpose (a view), as `w.t()` is.
    flip = {"x @ w.t()": (False, True), "g.t() @ x": (True, False), "bmm, left transposed": (True, False)}[case]

    def transposed(x, yes):
        return jax.numpy.swapaxes(x, -1, -2) if yes else x

    def program(x, y):
        return precision.dot_general(transposed(x, flip[0]), transposed(y, flip[1]), dims, "default", "cpu")

    a, b = transposed(np.ones(lhs, np.float32), flip[0]), transposed(np.ones(rhs, np.float32), flip[1])
    hlo = jax.jit(program).lower(a, b).compile().as_text()
    operands = _dot_operand_types(hlo)
    assert operands and all(t == ("bf16", "bf16") for t in operands), operands


def test_bf16_dot_override_is_checked(monkeypatch):
    from torchtpu import precision

    monkeypatch.setenv("TORCHTPU_CPU_BF16_DOT", "yes")
    with pytest.raises(ValueError, match="TORCHTPU_CPU_BF16_DOT must be 0 or 1"):
        precision.host_has_bf16_dot.__wrapped__()
    monkeypatch.setenv("TORCHTPU_CPU_BF16_DOT", "0")
    assert precision.host_has_bf16_dot.__wrapped__() is False


@pytest.mark.skipif(not __import__("torchtpu.precision").precision.host_has_bf16_dot(),
                    reason="this host's CPU has no native bf16 dot: passes are widened to fp32")
def test_a_transposed_weight_view_is_read_as_stored():
    """`x @ w.t()` (every `nn.Linear`): the mm lowering sees from `w.t()`'s strides that it is a
    transposed view, so the stand-in's bf16 dot reads `w` as stored -- no transpose, no copy."""
    x, w = torch.randn(64, 96, device="tpu"), torch.randn(48, 96, device="tpu")
    rounded = [t.cpu().bfloat16().double() for t in (x, w)]  # `default`: bf16 products
    torch.testing.assert_close((x @ w.t()).cpu().double(), rounded[0] @ rounded[1].t(), rtol=1e-5, atol=1e-5)
    hlo = _lowered(aten.mm.default).compile().as_text()
    assert _dot_operand_types(hlo) == [("bf16", "bf16")]
    assert not re.search(r" (transpose|copy)\(", hlo), hlo
