"""Matrix products and linear algebra on `tpu` against PyTorch's CPU kernels.

Products: every overload, `beta == 0` ignoring NaN, broadcasting of `self`, non-contiguous
operands, empty contractions, integer wraparound, bf16 rounding once, out= and in-place variants
through the executor. Linear algebra: factorizations, solves and their LAPACK conventions
(pivots, info codes), singular and batched inputs, gradients. float32 comparisons run at
`highest` precision (test_precision.py covers the modes themselves).
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import torchtpu
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401
from value_and_grad import Draws

DRAWS = Draws(0)
GEN = DRAWS.generator


def randn(*shape, dtype=torch.float32):
    return DRAWS.randn(*shape, dtype=dtype)



@pytest.fixture(autouse=True)
def highest():
    with torch.tpu.precision("highest"):
        yield


def close(fn, *args):
    same_as_cpu(fn, *args, exact=False)


# --- products ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (torch.mm, [(5, 3), (3, 4)]),
        (torch.bmm, [(2, 5, 3), (2, 3, 4)]),
        (torch.mv, [(5, 3), (3,)]),
        (torch.dot, [(7,), (7,)]),
        (torch.vdot, [(7,), (7,)]),
        (torch.matmul, [(2, 1, 5, 3), (4, 3, 2)]),
        (lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=-2), [(5, 4), (5, 3), (3, 4)]),
        (lambda s, a, b: torch.addmv(s, a, b, beta=2, alpha=0.5), [(5,), (5, 3), (3,)]),
        (lambda s, a, b: torch.baddbmm(s, a, b, beta=-1, alpha=3), [(2, 5, 4), (2, 5, 3), (2, 3, 4)]),
        (lambda s, a, b: torch.addbmm(s, a, b, beta=0.25, alpha=2), [(5, 4), (3, 5, 2), (3, 2, 4)]),
        (torch.outer, [(4,), (3,)]),
        (lambda s, a, b: torch.addr(s, a, b, beta=2, alpha=3), [(4, 3), (4,), (3,)]),
    ],
)
def test_products(fn, shapes):
    close(fn, *[randn(*s) for s in shapes])


@pytest.mark.parametrize("self_shape", [(4,), (1, 4), (5, 1), ()])
def test_addmm_broadcasts_self(self_shape):
    close(torch.addmm, randn(*self_shape), randn(5, 3), randn(3, 4))


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (torch.addmm, [(5, 4), (5, 3), (3, 4)]),
        (torch.addmv, [(5,), (5, 3), (3,)]),
        (torch.baddbmm, [(2, 5, 4), (2, 5, 3), (2, 3, 4)]),
        (torch.addbmm, [(5, 4), (2, 5, 3), (2, 3, 4)]),
    ],
)
def test_beta_zero_ignores_self(fn, shapes):
    self = torch.full(shapes[0], math.nan)
    close(lambda s, a, b: fn(s, a, b, beta=0), self, randn(*shapes[1]), randn(*shapes[2]))


def test_non_contiguous_operands():
    a, b = randn(3, 5).t(), randn(6, 8)[::2, 1::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    close(torch.mm, a, b)
    close(torch.bmm, randn(3, 4, 2).transpose(0, 1), randn(4, 5, 2).transpose(1, 2))


def test_empty_contraction_gives_zeros():
    same_as_cpu(torch.mm, randn(3, 0), randn(0, 4))
    same_as_cpu(lambda s, a, b: torch.addmm(s, a, b, beta=2), randn(3, 4), randn(3, 0), randn(0, 4))
    same_as_cpu(torch.bmm, randn(0, 3, 2), randn(0, 2, 4))


def test_integer_products_wrap_around():
    big = torch.full((2, 3), 2**62, dtype=torch.int64)
    same_as_cpu(torch.mm, big, torch.full((3, 2), 3, dtype=torch.int64))
    same_as_cpu(torch.mv, torch.arange(12).reshape(3, 4), torch.arange(4))
    same_as_cpu(lambda s, a, b: torch.addmm(s, a, b, beta=2, alpha=3),
                torch.arange(4), torch.arange(12).reshape(3, 4), torch.ones(4, 4, dtype=torch.int64))


def test_int_mm():
    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=GEN)
    b = torch.randint(-128, 128, (64, 16), dtype=torch.int8, generator=GEN)
    same_as_cpu(torch._int_mm, a, b)


def test_bf16_accumulates_in_fp32_and_rounds_once():
    a, b, c = randn(16, 64), randn(64, 8), randn(16, 8)
    a16, b16, c16 = a.bfloat16(), b.bfloat16(), c.bfloat16()
    actual = torch.addmm(c16.to("tpu"), a16.to("tpu"), b16.to("tpu")).cpu()
    exact = torch.addmm(c16.double(), a16.double(), b16.double())
    assert actual.dtype == torch.bfloat16
    # One rounding of the float32 result: within half a bf16 ulp (plus fp32 accumulation noise).
    torch.testing.assert_close(actual.double(), exact, rtol=2**-8, atol=1e-3)
    same_as_cpu(torch.mm, a16, b16, exact=False)


OUT_DTYPE_PRODUCTS = {
    "mm": lambda a, b, c, **kw: torch.mm(a, b, **kw),
    "addmm": lambda a, b, c, **kw: torch.addmm(c, a, b, beta=0.5, alpha=2, **kw),
    "bmm": lambda a, b, c, **kw: torch.bmm(a[None], b[None], **kw),
    "baddbmm": lambda a, b, c, **kw: torch.baddbmm(c[None], a[None], b[None], beta=0.5, alpha=2, **kw),
}


@pytest.mark.parametrize("name", sorted(OUT_DTYPE_PRODUCTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_products_accumulate_into_a_float32_result(name, dtype):
    """`out_dtype=torch.float32` of bf16/f16 operands (PyTorch has these overloads on CUDA only,
    so the reference is its CPU product of the operands widened to float32: exact products,
    float32 sums); `out_dtype` equal to the operands' is the plain product."""
    g = torch.Generator().manual_seed(7)
    a, b, c = (torch.randn(shape, generator=g).to(dtype) for shape in ((6, 32), (32, 5), (6, 5)))
    fn = OUT_DTYPE_PRODUCTS[name]
    moved = [t.to("tpu") for t in (a, b, c)]
    widened = fn(a.float(), b.float(), c.float())
    torch.testing.assert_close(fn(*moved, out_dtype=torch.float32).cpu(), widened, rtol=1e-6, atol=1e-5)
    same_dtype = fn(*moved, out_dtype=dtype).cpu()
    assert same_dtype.dtype == dtype
    torch.testing.assert_close(same_dtype, widened.to(dtype), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="out_dtype"):  # PyTorch's meta kernels refuse it
        fn(*moved, out_dtype=torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)


def test_out_and_inplace_variants():
    a, b = randn(5, 3), randn(3, 4)
    out = torch.empty(5, 4, device="tpu")
    result = torch.mm(a.to("tpu"), b.to("tpu"), out=out)
    assert result is out
    torch.testing.assert_close(out.cpu(), a @ b)
    c = randn(5, 4)
    c_tpu = c.to("tpu")
    c_tpu.addmm_(a.to("tpu"), b.to("tpu"), beta=0.5)
    torch.testing.assert_close(c_tpu.cpu(), torch.addmm(c, a, b, beta=0.5))
    # An in-place product into a non-contiguous view writes through to its base.
    base = torch.zeros(4, 5, device="tpu")
    torch.mm(a.to("tpu"), b.to("tpu"), out=base.t())
    torch.testing.assert_close(base.cpu().t(), a @ b)


def test_einsum_and_tensordot_run_natively():
    close(lambda x, y: torch.einsum("bij,bjk->bik", x, y), randn(2, 3, 4), randn(2, 4, 5))
    close(lambda x, y: torch.einsum("ij,kj->ik", x, y), randn(3, 4), randn(5, 4))
    close(lambda x, y: torch.tensordot(x, y, dims=([1, 2], [0, 1])), randn(2, 3, 4), randn(3, 4, 5))


def test_product_gradients():
    grads_same_as_cpu(lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=2),
                      randn(4, dtype=torch.float64), randn(5, 3, dtype=torch.float64),
                      randn(3, 4, dtype=torch.float64))
    grads_same_as_cpu(torch.bmm, randn(2, 5, 3, dtype=torch.float64), randn(2, 3, 4, dtype=torch.float64))


def test_mismatched_shapes_raise_like_cpu():
    with pytest.raises(RuntimeError):
        torch.mm(randn(2, 3).to("tpu"), randn(4, 5).to("tpu"))


# --- linear algebra ---------------------------------------------------------------------------


def spd(*batch, n=4, dtype=torch.float64):
    a = randn(*batch, n, n, dtype=dtype)
    return a @ a.mT + n * torch.eye(n, dtype=dtype)


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky(upper):
    a = spd(2)
    close(lambda x: torch.linalg.cholesky(x, upper=upper), a)
    close(lambda x: torch.cholesky(x, upper=upper), a)
    factor = torch.linalg.cholesky(a, upper=upper)
    b = randn(2, 4, 3, dtype=torch.float64)
    close(lambda f, y: torch.cholesky_solve(y, f, upper=upper), factor, b)
    close(lambda f: torch.cholesky_inverse(f, upper=upper), factor[0])
    close(lambda f, y: torch.cholesky_solve(y, f, upper=upper), factor[:1], randn(3, 1, 4, 2, dtype=torch.float64))


GROUPED = {  # mat_a, mat_b, offs (cumulative group ends; an empty group, uncovered tails)
    "rows": ((12, 16), (3, 16, 8), [3, 3, 10]),
    "columns": ((3, 6, 16), (16, 24), [8, 16, 20]),
    "contraction": ((8, 32), (32, 8), [8, 24, 32]),
    "batched": ((3, 4, 16), (3, 16, 8), None),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", sorted(GROUPED))
def test_grouped_mm_matches_cpu_with_gradients(mode, dtype):
    """`torch._grouped_mm` (mixture-of-experts layers; HF's call it in float32) in each of its
    four forms, values and gradients against PyTorch's CPU kernel: bit for bit in bf16 (float32
    accumulation), to float32's rounding at the `highest` precision. Rows or columns past the
    last group are zero (the CPU kernel leaves them unwritten)."""
    shape_a, shape_b, ends = GROUPED[mode]
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*shape, generator=g).to(dtype) for shape in (shape_a, shape_b))
    tolerance = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    offs = None if ends is None else torch.tensor(ends, dtype=torch.int32)

    def run(device):
        leaves = [a.to(device).requires_grad_(), b.to(device).requires_grad_()]
        out = torch._grouped_mm(*leaves, None if offs is None else offs.to(device))
        covered = out[:10] if mode == "rows" else out[:, :20] if mode == "columns" else out
        cotangent = torch.linspace(-1, 1, covered.numel()).view(covered.shape).to(dtype)
        (covered * cotangent.to(device)).sum().backward()
        return covered.detach().cpu(), out.detach().cpu(), [x.grad.cpu() for x in leaves]

    with torch.tpu.precision("highest"):
        (covered, out, grads), (expected, _, expected_grads) = run("tpu"), run("cpu")
    torch.testing.assert_close(covered, expected, **tolerance)
    # The uncovered rows of mat_a (columns of mat_b) and their gradient: zero here, unwritten on CPU.
    split = {  # mode: (the operand, its covered part, its uncovered part)
        "rows": (0, (slice(None, 10),), (slice(10, None),)),
        "columns": (1, (slice(None), slice(None, 20)), (slice(None), slice(20, None))),
    }.get(mode)
    if split is not None:
        operand, head, tail = split
        assert not out[tail].any() and not grads[operand][tail].any()
        grads[operand], expected_grads[operand] = grads[operand][head], expected_grads[operand][head]
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, **tolerance)


@pytest.mark.parametrize("call, message", [
    (lambda a, b, o: torch._grouped_mm(a.double(), b.double(), o), "Expected mat_a to be Float32, BFloat16 or Float16"),
    (lambda a, b, o: torch._grouped_mm(a, b, o.long()), "Offsets have to be int32"),
    (lambda a, b, o: torch._grouped_mm(a, b[:, 1:], o), "contraction dimension of mat_a and mat_b must match"),
    (lambda a, b, o: torch._grouped_mm(a, b, o[1:]), "matrix batch sizes have to match"),
    (lambda a, b, o: torch._grouped_mm(a, b), "Have to provide offsets if there is a 2d matrix"),
    (lambda a, b, o: torch._grouped_mm(a, b, o, bias=b[:, 0]), "Bias not supported yet"),
    (lambda a, b, o: torch._grouped_mm(a, b, o, out_dtype=torch.bfloat16), "output dtype must match `mat_a` dtype"),
], ids=["float64", "int64_offsets", "contraction", "groups", "no_offsets", "bias", "out_dtype"])
def test_grouped_mm_refuses_what_pytorchs_cpu_kernel_refuses(call, message):
    """The CPU kernel's checks and messages (PyTorch's meta kernel states CUDA's, bf16 only)."""
    a, b, offs = torch.randn(12, 16), torch.randn(3, 16, 8), torch.tensor([3, 7, 12], dtype=torch.int32)
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call(a.to(device), b.to(device), offs.to(device))


def test_grouped_mm_offsets_are_checked_on_the_device_and_compile_into_one_program():
    """Offsets that decrease fail at the next sync, naming the rule; the op no longer splits a
    compiled graph."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(12, 16, generator=g).to(torch.bfloat16), torch.randn(3, 16, 8, generator=g).to(torch.bfloat16)
    torch._grouped_mm(a.to("tpu"), b.to("tpu"), torch.tensor([5, 3, 12], dtype=torch.int32).to("tpu"))
    with pytest.raises(RuntimeError, match="offs must be non-decreasing group ends of at most 12, along the rows"):
        torch.tpu.synchronize()
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        got = torch.compile(lambda x, w, o: torch._grouped_mm(x, w, o).relu(), backend="tpu")(
            a.to("tpu"), b.to("tpu"), offs.to("tpu"))
    torch.testing.assert_close(got.cpu(), torch._grouped_mm(a, b, offs).relu(), rtol=0, atol=0)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_cholesky_solve_compiles_into_one_program():
    """PyTorch's `cholesky_solve` is a composite that compiled graphs keep whole: lowered, with
    its batch dims broadcast, it no longer splits the graph."""
    factor = torch.linalg.cholesky(spd(2, dtype=torch.float32))
    b = randn(3, 1, 4, 2)
    with torch.tpu.precision("highest"), warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        got = torch.compile(lambda y, f: torch.cholesky_solve(y, f) * 2, backend="tpu")(b.to("tpu"), factor.to("tpu"))
    torch.testing.assert_close(got.cpu(), torch.cholesky_solve(b, factor) * 2, rtol=1e-5, atol=1e-5)
    assert "compiled_graphs_split" not in torchtpu.metrics()


def test_cholesky_ex_reports_the_failing_minor():
    a = spd(n=4)
    a[2, 2] = -10.0
    _, info = torch.linalg.cholesky_ex(a.to("tpu"))
    assert info.item() == torch.linalg.cholesky_ex(a).info.item() == 3
    with pytest.raises(torch.linalg.LinAlgError, match="order 3 is not positive-definite"):
        torch.linalg.cholesky(a.to("tpu"))


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("unit", [False, True])
def test_triangular_solve(upper, transpose, unit):
    a = randn(3, 4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    b = randn(4, 2, dtype=torch.float64)  # broadcast against A's batch
    close(lambda x, y: torch.triangular_solve(y, x, upper=upper, transpose=transpose,
                                              unitriangular=unit), a, b)


@pytest.mark.parametrize("left", [False, True])
def test_solve_triangular(left):
    a = randn(2, 4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    b = randn(2, 4, 3, dtype=torch.float64) if left else randn(2, 3, 4, dtype=torch.float64)
    close(lambda x, y: torch.linalg.solve_triangular(x, y, upper=True, left=left), a, b)


def test_lu_factor_matches_lapack():
    a = randn(2, 5, 5, dtype=torch.float64)
    same_as_cpu(torch.linalg.lu_factor_ex, a, exact=False)
    close(torch.linalg.lu, randn(4, 6, dtype=torch.float64))  # rectangular
    lu, pivots = torch.linalg.lu_factor(a)
    close(torch.lu_unpack, lu, pivots)
    close(lambda x, p: torch.lu_unpack(x, p, unpack_data=False), lu, pivots)


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("adjoint", [False, True])
def test_lu_solve(left, adjoint):
    a = randn(2, 4, 4, dtype=torch.float64)
    lu, pivots = torch.linalg.lu_factor(a)
    b = randn(2, 4, 3, dtype=torch.float64) if left else randn(2, 3, 4, dtype=torch.float64)
    close(lambda x, p, y: torch.linalg.lu_solve(x, p, y, left=left, adjoint=adjoint), lu, pivots, b)


def test_lu_factor_reports_singular_pivot():
    a = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    same_as_cpu(lambda x: torch.linalg.lu_factor_ex(x).info, a)


def test_solve_inverse_determinant():
    a, b = randn(3, 4, 4, dtype=torch.float64), randn(4, dtype=torch.float64)
    close(torch.linalg.solve, a, b)  # a vector right-hand side
    close(torch.linalg.solve, a, randn(2, 1, 4, 2, dtype=torch.float64))  # broadcast batches
    close(lambda x, y: torch.linalg.solve(x, y, left=False), a, randn(3, 2, 4, dtype=torch.float64))
    close(torch.linalg.inv, a)
    close(torch.linalg.det, a)
    close(torch.linalg.slogdet, a)
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    close(torch.linalg.slogdet, singular)
    close(torch.linalg.det, singular)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.inv(torch.zeros(3, 3, device="tpu"))


def test_empty_matrices():
    close(torch.linalg.det, randn(0, 0, dtype=torch.float64))
    close(torch.linalg.inv, randn(2, 0, 0, dtype=torch.float64))
    close(torch.linalg.cholesky, randn(0, 0, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
def test_qr(mode):
    close(lambda x: torch.linalg.qr(x, mode=mode), randn(2, 5, 3, dtype=torch.float64))


def test_householder_reflectors():
    a = randn(5, 3, dtype=torch.float64)
    close(torch.geqrf, a)
    reflectors, tau = torch.geqrf(a)
    close(torch.linalg.householder_product, reflectors, tau)
    for left in (False, True):
        for transpose in (False, True):
            c = randn(5, 2, dtype=torch.float64) if left else randn(2, 5, dtype=torch.float64)
            close(lambda r, t, y: torch.ormqr(r, t, y, left=left, transpose=transpose),
                  reflectors, tau, c)


def test_spectral_decompositions():
    a = spd(2, n=5)
    close(torch.linalg.eigvalsh, a)
    close(lambda x: torch.linalg.eigvalsh(x, UPLO="U"), torch.triu(a))  # reads the upper triangle
    values, vectors = torch.linalg.eigh(a.to("tpu"))
    torch.testing.assert_close((vectors * values[..., None, :] @ vectors.mT).cpu(), a)
    m = randn(2, 5, 3, dtype=torch.float64)
    close(torch.linalg.svdvals, m)
    u, s, vh = torch.linalg.svd(m.to("tpu"), full_matrices=True)
    assert u.shape == (2, 5, 5) and vh.shape == (2, 3, 3)
    torch.testing.assert_close((u[..., :3] * s[..., None, :] @ vh).cpu(), m)
    close(torch.linalg.pinv, m)
    close(torch.linalg.matrix_rank, m)


@pytest.mark.parametrize("n", [1, 4, 12])
def test_ldl_factor_and_solve(n):
    a = randn(3, n, n, dtype=torch.float64)
    a = a + a.mT
    a[1].diagonal().mul_(1e-3)  # small diagonals force 2x2 pivot blocks
    same_as_cpu(torch.linalg.ldl_factor_ex, a, exact=False)
    ld, pivots = torch.linalg.ldl_factor(a)
    close(torch.linalg.ldl_solve, ld, pivots, randn(3, n, 2, dtype=torch.float64))
    close(torch.linalg.ldl_solve, ld[0], pivots[0], randn(2, n, 3, dtype=torch.float64))


def test_matrix_exp():
    close(torch.linalg.matrix_exp, randn(3, 4, 4, dtype=torch.float64) / 2)


@pytest.mark.parametrize("driver", [None, "gels", "gelsd", "gelss"])
def test_lstsq(driver):
    a, b = randn(2, 6, 3, dtype=torch.float64), randn(2, 6, 2, dtype=torch.float64)
    close(lambda x, y: torch.linalg.lstsq(x, y, driver=driver), a, b)
    if driver != "gels":  # gels assumes full rank
        deficient = a.clone()
        deficient[..., 2] = deficient[..., 1]  # rank 2: the minimum-norm solution, no residuals
        close(lambda x, y: torch.linalg.lstsq(x, y, driver=driver), deficient, b)


def test_linalg_gradients():
    # ATen factors a contiguous A transposed and its backward formulas rely on it: both layouts.
    a = randn(3, 3, dtype=torch.float64)
    grads_same_as_cpu(torch.linalg.det, a)
    grads_same_as_cpu(lambda x: torch.linalg.det(x.mT), a)
    grads_same_as_cpu(lambda x: torch.linalg.slogdet(x).logabsdet, a)
    grads_same_as_cpu(lambda x, y: torch.linalg.solve(x.mT, y), a, randn(3, 2, dtype=torch.float64))
    grads_same_as_cpu(torch.linalg.solve, randn(3, 3, dtype=torch.float64),
                      randn(3, 2, dtype=torch.float64))
    grads_same_as_cpu(torch.linalg.cholesky, spd(n=3))
    grads_same_as_cpu(torch.linalg.inv, randn(3, 3, dtype=torch.float64))
    grads_same_as_cpu(torch.linalg.eigvalsh, spd(n=3))
