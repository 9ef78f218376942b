"""Matrix products (mm, bmm, addmm, ... with TPU precision modes, and their `out_dtype` forms) and
linear algebra.

Every floating-point product goes through `torchtpu.precision.dot_general`, so the matmul
precision mode (1, 3 or 6 bf16 passes for float32) holds for all of them; bf16/f16 operands
accumulate in float32 and round once, as PyTorch's CPU kernels do. The `add*` family follows
ATen: `beta * self + alpha * product`, and `beta == 0` ignores `self` (NaN in it does not
propagate).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg
import numpy as np
import torch
from jax import lax
from jax.lax import linalg as lax_linalg

from torchtpu import dtypes, precision
from torchtpu.ops import registry
from torchtpu.ops.reduction import opmath

aten = torch.ops.aten

# dimension_numbers of lax.dot_general: ((lhs contracting, rhs contracting), (lhs batch, rhs batch))
_MM = (((1,), (0,)), ((), ()))
_BMM = (((2,), (1,)), ((0,), (0,)))
_MV = (((1,), (0,)), ((), ()))
_DOT = (((0,), (0,)), ((), ()))


def product(ctx, a, b, dimension_numbers, b_arg: str | None = None):
    """`a`·`b` in the call's precision mode, in opmath dtype (float32 for bf16/f16 results).
    `b_arg`: the schema argument `b` comes from, whose strides tell whether it is a transposed
    view (`w.t()`), which the stand-in's bf16 dot can then read as stored."""
    return precision.dot_general(
        a, b, dimension_numbers, ctx.precision, ctx.platform, opmath(ctx.out_dtype()),
        rhs_transposed=b_arg is not None and _transposed(ctx.arg(b_arg)),
    )


def _transposed(meta) -> bool:
    """Whether a matrix (or batch of matrices) is stored with its last two dimensions swapped,
    as `w.t()` or `x.transpose(-1, -2)` of a contiguous tensor is."""
    if not isinstance(meta, torch.Tensor) or meta.dim() < 2:
        return False
    rows, cols = meta.shape[-2:]
    return rows > 1 and cols > 1 and meta.stride(-2) == 1 and meta.stride(-1) == rows


def _accumulate(ctx, self, prod, beta, alpha):
    """`beta * self + alpha * prod`, with `self` ignored when `beta == 0`, in `prod`'s dtype."""
    out = prod if alpha == 1 else prod * jnp.asarray(alpha, prod.dtype)
    if beta != 0:
        self = self.astype(prod.dtype)
        out = out + (self if beta == 1 else self * jnp.asarray(beta, prod.dtype))
    return out.astype(ctx.out_dtype())


@registry.register(aten.mm.default)
def mm(ctx, a, b):
    return product(ctx, a, b, _MM, "mat2")


@registry.register(aten.bmm.default)
def bmm(ctx, a, b):
    return product(ctx, a, b, _BMM, "mat2")


@registry.register(aten.mm.dtype)
def mm_out_dtype(ctx, a, b, out_dtype):
    """`torch.mm(..., out_dtype=)`: bf16/f16 operands into a float32 result, accumulated in
    float32 and never rounded to the operands' dtype (the meta kernel checks the dtypes)."""
    return product(ctx, a, b, _MM, "mat2")


@registry.register(aten.bmm.dtype)
def bmm_out_dtype(ctx, a, b, out_dtype):
    return product(ctx, a, b, _BMM, "mat2")


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_meta(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """ATen's CPU kernel's checks and output (PyTorch's meta kernel states CUDA's: bf16 only,
    and HF's mixture-of-experts layers call the op in float32)."""
    for name, t in (("mat_a", a), ("mat_b", b)):
        if t.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
        if t.dtype not in _GROUPED_MM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got "
                               f"{dtypes.aten_name(t.dtype)}")
    if (offs is None) != (a.dim() == 3 and b.dim() == 3):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and offs.dtype != torch.int32:
        raise RuntimeError("Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and out_dtype != a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a.shape[-1] != b.shape[-2 if b.dim() == 3 else 0]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    groups = offs.shape[0] if offs is not None else a.shape[0]
    if (b.dim() == 3 and b.shape[0] != groups) or (a.dim() == 3 and a.shape[0] != groups):
        raise RuntimeError("matrix batch sizes have to match")
    if a.dim() == 2:
        shape = (groups, a.shape[0], b.shape[1]) if b.dim() == 2 else (a.shape[0], b.shape[-1])
    else:
        shape = (a.shape[1], b.shape[1]) if b.dim() == 2 else (groups, a.shape[1], b.shape[-1])
    return torch.empty(shape, dtype=a.dtype, device="meta")


@registry.register(aten._grouped_mm.default, meta=_grouped_mm_meta)
def grouped_mm(ctx, a, b, offs=None, bias=None, out_dtype=None):
    """Products of groups (mixture-of-experts layers): `offs` holds the groups' cumulative ends
    along the ragged dimension, and each group is multiplied by its own matrix --
    `[M, K] x [G, K, N]`: rows of `a` by group; `[G, M, K] x [K, N]`: columns of `b` by group;
    `[M, K] x [K, N]`: the contraction by group, one `[M, N]` product each; without `offs`,
    `[G, M, K] x [G, K, N]` is a batched product. XLA's ragged dot (grouped matmuls on TPU) in
    the call's precision mode. Rows (columns) past the last group are zero, where ATen's CPU
    kernel leaves them unwritten; offsets that decrease or run past their dimension are a
    device-side error. float32, bf16 and f16 operands, as ATen's CPU kernel takes them
    (`_grouped_mm_meta`)."""
    out = ctx.out_dtype()
    if offs is None:
        return precision.dot_general(a, b, _BMM, ctx.precision, ctx.platform, out)
    if a.ndim == 2 and b.ndim == 3:
        ragged, extent = "rows of mat_a", a.shape[0]
    elif a.ndim == 3:
        ragged, extent = "columns of mat_b", b.shape[1]
    else:
        ragged, extent = "the contraction", a.shape[1]
    ends = offs.astype(jnp.int32)
    sizes = jnp.diff(ends, prepend=0)
    ctx.check((sizes >= 0) & (ends <= extent), f"offs must be non-decreasing group ends of at most {extent}, "
              f"along the {ragged}")

    def ragged_dot(lhs, rhs, dimension_numbers):
        op = functools.partial(lax.ragged_dot_general, group_sizes=sizes,
                               ragged_dot_dimension_numbers=dimension_numbers)
        return precision.bilinear(op, lhs, rhs, ctx.precision, ctx.platform, out)

    if a.ndim == 2 and b.ndim == 3:
        return ragged_dot(a, b, _RAGGED_ROWS)
    if a.ndim == 3:
        # Columns of `b` by group: the transposed product has them as ragged rows.
        return ragged_dot(b.T, jnp.swapaxes(a, 1, 2), _RAGGED_ROWS).T
    return ragged_dot(a, b, _RAGGED_CONTRACTION)


# Ragged dots: the rows of the left operand by group, each with its own right matrix (the right
# operand's leading dimension); the contraction by group, a product per group.
_RAGGED_ROWS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_RAGGED_CONTRACTION = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1], rhs_group_dimensions=[])


@registry.register(aten.mv.default)
def mv(ctx, a, v):
    return product(ctx, a, v, _MV)


@registry.register(aten.dot.default, aten.vdot.default)
def dot(ctx, a, b):
    # vdot conjugates its first operand: the same as dot for the real dtypes the device has.
    return product(ctx, a, b, _DOT)


@registry.register(aten.addmm.default)
def addmm(ctx, self, a, b, *, beta=1, alpha=1):
    return _accumulate(ctx, self, product(ctx, a, b, _MM, "mat2"), beta, alpha)


@registry.register(aten.addmm.dtype)
def addmm_out_dtype(ctx, self, a, b, out_dtype, *, beta=1, alpha=1):
    return _accumulate(ctx, self, product(ctx, a, b, _MM, "mat2"), beta, alpha)


@registry.register(aten.addmv.default)
def addmv(ctx, self, a, v, *, beta=1, alpha=1):
    return _accumulate(ctx, self, product(ctx, a, v, _MV), beta, alpha)


@registry.register(aten.baddbmm.default)
def baddbmm(ctx, self, a, b, *, beta=1, alpha=1):
    return _accumulate(ctx, self, product(ctx, a, b, _BMM, "batch2"), beta, alpha)


def _baddbmm_out_dtype_meta(self, batch1, batch2, out_dtype, *, beta=1, alpha=1):
    """`baddbmm.dtype`'s output metadata: PyTorch's meta kernel for it is its `baddbmm`
    decomposition, registered for every overload, which reads `out_dtype` as `beta` and fails."""
    out = aten.bmm.dtype(batch1, batch2, out_dtype)
    if torch.broadcast_shapes(self.shape, out.shape) != out.shape:
        raise RuntimeError(f"baddbmm: self of shape {list(self.shape)} does not broadcast to the "
                           f"product's shape {list(out.shape)}")
    return out


@registry.register(aten.baddbmm.dtype, meta=_baddbmm_out_dtype_meta)
def baddbmm_out_dtype(ctx, self, a, b, out_dtype, *, beta=1, alpha=1):
    """(PyTorch's own decomposition of `baddbmm` is registered for this overload too, and reads
    `out_dtype` as `beta`: this lowering comes first.)"""
    return _accumulate(ctx, self, product(ctx, a, b, _BMM, "batch2"), beta, alpha)


@registry.register(aten.addbmm.default)
def addbmm(ctx, self, a, b, *, beta=1, alpha=1):
    # Contract the batch dimension together with k: sum_b a[b] @ b[b] is one matmul.
    return _accumulate(ctx, self, product(ctx, a, b, (((0, 2), (0, 1)), ((), ()))), beta, alpha)


@registry.register(aten.linalg_cross.default)
def linalg_cross(ctx, a, b, *, dim=-1):
    # Lowered (rather than decomposed) so bf16 products round once, in opmath, as on CPU.
    compute = opmath(ctx.out_dtype())
    return jnp.cross(a.astype(compute), b.astype(compute), axis=dim)


@registry.register(aten._int_mm.default)
def int_mm(ctx, a, b):
    return precision.dot_general(a, b, _MM, ctx.precision, ctx.platform, np.int32)


# --- factorizations and solvers ---------------------------------------------------------------
# Through jax.lax.linalg (LAPACK on the CPU stand-in, XLA's own algorithms on a TPU), with ATen's
# conventions: LAPACK-style LU (1-based int32 pivots) and `info` codes, lower or upper triangles
# read as asked, batch dimensions broadcast.


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _broadcast_batch(a, b):
    """a and b with their batch (all but the last two) dimensions broadcast together."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _first_failure(bad):
    """LAPACK's info: 1 + the first index where `bad` holds along the last axis, else 0."""
    if bad.shape[-1] == 0:
        return jnp.zeros(bad.shape[:-1], np.int32)
    index = jnp.argmax(bad, -1).astype(np.int32) + 1
    return jnp.where(jnp.any(bad, -1), index, 0).astype(np.int32)


def _triangular_solve(a, b, *, lower: bool, left: bool = True, transpose: bool = False,
                      unit: bool = False):
    a, b = _broadcast_batch(a, b)
    return lax_linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=transpose,
                                       unit_diagonal=unit)


def _cholesky(x, upper: bool):
    """The Cholesky factor from the lower (or, for `upper`, the upper) triangle of x."""
    if upper:
        return _mT(jnp.tril(lax_linalg.cholesky(_mT(x), symmetrize_input=False)))
    return jnp.tril(lax_linalg.cholesky(x, symmetrize_input=False))


def _cholesky_info(a, upper: bool):
    """LAPACK's potrf info: the order of the first leading minor that is not positive definite.

    Found by elimination without pivoting, whose k-th pivot is the Schur complement that the
    Cholesky factorisation takes the square root of. XLA's Cholesky only yields NaN on failure,
    so this runs (under `lax.cond`) only then."""
    sym = jnp.triu(a) + _mT(jnp.triu(a, 1)) if upper else jnp.tril(a) + _mT(jnp.tril(a, -1))

    def eliminate(k, carry):
        m, info = carry
        pivot = m[..., k, k]
        info = jnp.where((info == 0) & ~(pivot > 0), k + 1, info)
        column = m[..., :, k] / pivot[..., None]
        return m - column[..., :, None] * m[..., None, k, :], info

    info = jnp.zeros(a.shape[:-2], np.int32)
    return lax.fori_loop(0, a.shape[-1], eliminate, (sym, info))[1]


@registry.register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(ctx, x, *, upper=False, check_errors=False):
    factor = _cholesky(x, upper)
    success = jnp.zeros(x.shape[:-2], np.int32)
    if x.shape[-1] == 0:
        return factor, success
    failed = jnp.any(jnp.isnan(jnp.diagonal(factor, axis1=-2, axis2=-1)))
    return factor, lax.cond(failed, lambda: _cholesky_info(x, upper), lambda: success)


@registry.register(aten.cholesky.default)
def cholesky(ctx, x, upper=False):
    return _cholesky(x, upper)


def _cholesky_solve(b, factor, upper: bool):
    """Solve (L L^T) X = B, or (U^T U) X = B, from the Cholesky factor."""
    y = _triangular_solve(factor, b, lower=not upper, transpose=upper)
    return _triangular_solve(factor, y, lower=not upper, transpose=not upper)


@registry.register(aten._cholesky_solve_helper.default)
def cholesky_solve_helper(ctx, b, factor, upper: bool):
    return _cholesky_solve(b, factor, upper)


@registry.register(aten.cholesky_solve.default)
def cholesky_solve(ctx, b, factor, upper=False):
    """`torch.cholesky_solve`, the batch dims of `b` and `factor` broadcast (what PyTorch's
    composite does before its helper; compiled graphs keep the composite whole, and were split)."""
    batch = jnp.broadcast_shapes(b.shape[:-2], factor.shape[:-2])
    return _cholesky_solve(jnp.broadcast_to(b, batch + b.shape[-2:]),
                           jnp.broadcast_to(factor, batch + factor.shape[-2:]), upper)


@registry.register(aten.cholesky_inverse.default)
def cholesky_inverse(ctx, factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return _cholesky_solve(eye, factor, upper)


@registry.register(aten.triangular_solve.default)
def triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    solution = _triangular_solve(a, b, lower=not upper, transpose=transpose, unit=unitriangular)
    return solution, jnp.broadcast_to(a, ctx.out_shape(1))


@registry.register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    return _triangular_solve(a, b, lower=not upper, left=left, unit=unitriangular)


# LU with partial pivoting: A = P L U; `pivots` are LAPACK's (row i swapped with pivots[i] - 1).


def _lu(a):
    """(LU, 1-based int32 pivots, permutation, info) of a (..., m, n)."""
    lu, pivots, permutation = lax_linalg.lu(a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return lu, (pivots + 1).astype(np.int32), permutation, _first_failure(diagonal == 0)


def _check_pivot(pivot: bool, name: str) -> None:
    if not pivot:
        raise NotImplementedError(f"{name}: LU without pivoting is not implemented on tpu")


def _unpack(lu, m: int, n: int):
    """(L (m, k) unit lower, U (k, n) upper) from packed LU."""
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    return lower, jnp.triu(lu[..., :k, :])


def _permutation_matrix(permutation, dtype):
    """P with A = P L U, from the row permutation with A[permutation] = L U."""
    return _mT(jax.nn.one_hot(permutation, permutation.shape[-1], dtype=dtype))


@registry.register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(ctx, a, *, pivot=True, check_errors=False):
    _check_pivot(pivot, "linalg.lu_factor")
    lu, pivots, _, info = _lu(a)
    return lu, pivots, info


@registry.register(aten.linalg_lu.default)
def linalg_lu(ctx, a, *, pivot=True):
    _check_pivot(pivot, "linalg.lu")
    lu, _, permutation, _ = _lu(a)
    lower, upper = _unpack(lu, *a.shape[-2:])
    return _permutation_matrix(permutation, a.dtype), lower, upper


@registry.register(aten.lu_unpack.default)
def lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    if unpack_data:
        lower, upper = _unpack(lu, m, n)
    else:
        lower, upper = jnp.zeros(ctx.out_shape(1), lu.dtype), jnp.zeros(ctx.out_shape(2), lu.dtype)
    if unpack_pivots:
        permutation = lax_linalg.lu_pivots_to_permutation(pivots.astype(np.int32) - 1, m)
        p = _permutation_matrix(permutation, lu.dtype)
    else:
        p = jnp.zeros(ctx.out_shape(0), lu.dtype)
    return p, lower, upper


def _lu_solve(lu, permutation, b, *, adjoint: bool):
    """Solve A X = B (or A^T X = B) for A = P L U, B (..., n, k)."""
    lu, b = _broadcast_batch(lu, b)
    permutation = jnp.broadcast_to(permutation, lu.shape[:-1])
    if not adjoint:
        b = jnp.take_along_axis(b, permutation[..., None], -2)
        y = lax_linalg.triangular_solve(lu, b, left_side=True, lower=True, unit_diagonal=True)
        return lax_linalg.triangular_solve(lu, y, left_side=True, lower=False)
    y = lax_linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True)
    y = lax_linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True,
                                    unit_diagonal=True)
    inverse = jnp.argsort(permutation, -1)
    return jnp.take_along_axis(y, inverse[..., None], -2)


def _solve(lu, permutation, b, *, left: bool, adjoint: bool):
    if left:
        return _lu_solve(lu, permutation, b, adjoint=adjoint)
    # X A = B  <=>  A^T X^T = B^T.
    return _mT(_lu_solve(lu, permutation, _mT(b), adjoint=not adjoint))


@registry.register(aten.linalg_lu_solve.default)
def linalg_lu_solve(ctx, lu, pivots, b, *, left=True, adjoint=False):
    permutation = lax_linalg.lu_pivots_to_permutation(pivots.astype(np.int32) - 1, lu.shape[-1])
    return _solve(lu, permutation, b, left=left, adjoint=adjoint)


@registry.register(aten._linalg_solve_ex.default)
def linalg_solve_ex(ctx, a, b, *, left=True, check_errors=False):
    lu, pivots, permutation, info = _lu(a)
    # B is a (batch of) vector(s) when it has one dimension less than A, as ATen decides.
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    rhs = b[..., :, None] if vector and left else (b[..., None, :] if vector else b)
    x = _solve(lu, permutation, rhs, left=left, adjoint=False)
    x = x[..., 0] if vector and left else (x[..., 0, :] if vector else x)
    return x, lu, pivots, info


@registry.register(aten.linalg_inv_ex.default)
def linalg_inv_ex(ctx, a, *, check_errors=False):
    lu, _, permutation, info = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, permutation, eye, adjoint=False), info


def _pivot_sign(pivots, dtype):
    """(-1)^(number of row swaps)."""
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), -1)
    return jnp.where(swaps % 2 == 0, 1, -1).astype(dtype)


def _factors_transpose(ctx) -> bool:
    """Whether ATen's det/slogdet factor A^T instead of A (they do for a contiguous real A, to
    hand LAPACK a column-major matrix). The LU is saved for the backward, whose formulas pick
    the adjoint solve accordingly, so the LU here must be the same factorisation."""
    return ctx.arg(0).is_contiguous()


@registry.register(aten._linalg_det.default)
def linalg_det(ctx, a):
    lu, pivots, _, _ = _lu(_mT(a) if _factors_transpose(ctx) else a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return _pivot_sign(pivots, a.dtype) * jnp.prod(diagonal, -1), lu, pivots


@registry.register(aten._linalg_slogdet.default)
def linalg_slogdet(ctx, a):
    lu, pivots, _, _ = _lu(_mT(a) if _factors_transpose(ctx) else a)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    sign = _pivot_sign(pivots, a.dtype) * jnp.prod(jnp.sign(diagonal), -1)
    return sign, jnp.sum(jnp.log(jnp.abs(diagonal)), -1), lu, pivots


# --- orthogonal factorizations and spectra ----------------------------------------------------


@registry.register(aten.linalg_qr.default)
def linalg_qr(ctx, a, mode="reduced"):
    q, r = lax_linalg.qr(a, full_matrices=mode == "complete")
    if mode == "r":
        return jnp.zeros(ctx.out_shape(0), a.dtype), r
    return q, r


@registry.register(aten.geqrf.default)
def geqrf(ctx, a):
    # jnp.linalg.qr's "raw" mode is LAPACK's geqrf, with the reflectors transposed.
    reflectors, tau = jnp.linalg.qr(a, mode="raw")
    return _mT(reflectors), tau


@registry.register(aten.linalg_householder_product.default)
def householder_product(ctx, reflectors, tau):
    return lax_linalg.householder_product(reflectors, tau)


@registry.register(aten.ormqr.default)
def ormqr(ctx, reflectors, tau, other, left=True, transpose=False):
    return lax_linalg.ormqr(reflectors, tau, other, left=left, transpose=transpose)


@registry.register(aten._linalg_eigh.default)
def linalg_eigh(ctx, a, UPLO="L", compute_v=True):
    vectors, values = lax_linalg.eigh(a, lower=UPLO == "L", symmetrize_input=False)
    if not compute_v:
        return values, jnp.zeros(ctx.out_shape(1), a.dtype)
    return values, vectors


@registry.register(aten._linalg_svd.default)
def linalg_svd(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        s = lax_linalg.svd(a, full_matrices=False, compute_uv=False)
        return jnp.zeros(ctx.out_shape(0), a.dtype), s, jnp.zeros(ctx.out_shape(2), a.dtype)
    return tuple(lax_linalg.svd(a, full_matrices=full_matrices, compute_uv=True))


@registry.register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(ctx, a):
    # The scaling-and-squaring products run at full precision: a solver's inner products
    # are not the user's matmuls, and bf16 passes would ruin the series.
    with jax.default_matmul_precision("highest"):
        return jax.scipy.linalg.expm(a.astype(opmath(a.dtype)))


@registry.register_data_dependent(aten.linalg_lstsq.default)
def linalg_lstsq(a: torch.Tensor, b: torch.Tensor, rcond: float | None = None, *,
                 driver: str | None = None):
    """Least squares through the SVD (the minimum-norm solution, as gelsd/gelss give; gelsy and
    gels agree with it on full-rank problems). Which outputs are filled follows the driver, as
    on CPU; the residuals exist only when every matrix has full column rank, a fact of the
    values: that is the one host read. Products run at `highest` precision -- they are inner
    steps of a solver, not the caller's matmuls."""
    driver = driver or "gelsy"
    if driver not in ("gels", "gelsy", "gelsd", "gelss"):
        raise RuntimeError(f"torch.linalg.lstsq: parameter `driver` should be one of "
                           f"(gels, gelsy, gelsd, gelss), but got {driver}")
    m, n = a.shape[-2:]
    vector = b.dim() == a.dim() - 1
    rhs = b.unsqueeze(-1) if vector else b
    with precision.precision("highest"):
        u, s, vh = torch.ops.aten._linalg_svd(a, False, True)
        if rcond is None or rcond < 0:
            rcond = torch.finfo(a.dtype).eps * max(m, n)
        kept = s > rcond * s[..., :1]
        inverse = torch.where(kept, 1 / torch.where(kept, s, 1), 0)
        solution = vh.mT @ (inverse.unsqueeze(-1) * (u.mT @ rhs))
        rank = kept.sum(-1)
        residuals = a.new_empty(0)
        if driver != "gelsy" and m > n and bool((rank == n).all()):
            residuals = ((a @ solution - rhs) ** 2).sum(-2)
            residuals = residuals.squeeze(-1) if vector else residuals
    solution = solution.squeeze(-1) if vector else solution
    return (
        solution,
        residuals,
        rank if driver != "gels" else a.new_empty(0, dtype=torch.int64),
        s if driver in ("gelsd", "gelss") else a.new_empty(0),
    )


# --- LDL^T (Bunch-Kaufman), in LAPACK's sytrf/sytrs format ------------------------------------
# A = P1 L1 D1 L1^T P1^T ... : each step eliminates a 1x1 or 2x2 pivot block chosen by the
# Bunch-Kaufman test and swaps rows/columns of the trailing matrix only, so `LD` holds the
# columns of L below D as the steps left them and `pivots` LAPACK's ipiv (1-based; a 2x2 block's
# two entries both -p). Steps advance by 1 or 2: a while_loop per matrix, vmapped over batches.

_BUNCH_KAUFMAN = (1 + 17**0.5) / 8


def _ldl_step(state):
    w, ld, pivots, k, info = state
    n = w.shape[-1]
    rows = jnp.arange(n)
    absakk = jnp.abs(w[k, k])
    below = jnp.where(rows > k, jnp.abs(w[:, k]), -1)
    imax = jnp.argmax(below)
    colmax = jnp.maximum(below[imax], 0)
    off = jnp.where((rows >= k) & (rows != imax), jnp.abs(w[:, imax]), -1)
    rowmax = jnp.max(off)
    zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
    keep = zero | (absakk >= _BUNCH_KAUFMAN * colmax) | (
        absakk >= _BUNCH_KAUFMAN * colmax * (colmax / rowmax))
    single = keep | (jnp.abs(w[imax, imax]) >= _BUNCH_KAUFMAN * rowmax)
    kp = jnp.where(keep, k, imax)
    kk = jnp.where(single, k, k + 1)
    order = rows.at[kk].set(kp).at[kp].set(kk)
    w = w[order][:, order]
    # One pivot: d = w[k, k], L column x / d, trailing update -x x^T / d (as dsyr computes it).
    x = jnp.where(rows > k, w[:, k], 0)
    r1 = jnp.where(zero, 0, 1 / w[k, k])
    w1 = w + jnp.outer(x, -r1 * x)
    ld1 = ld.at[:, k].set(jnp.where(rows > k, x * r1, jnp.where(rows == k, w[k, k], 0)))
    # Two pivots: LAPACK's scaled inverse of the 2x2 block D = w[k:k+2, k:k+2].
    d21 = w[k + 1, k]
    d11, d22 = w[k + 1, k + 1] / d21, w[k, k] / d21
    d21 = (1 / (d11 * d22 - 1)) / d21
    a0, a1 = jnp.where(rows > k + 1, w[:, k], 0), jnp.where(rows > k + 1, w[:, k + 1], 0)
    wk, wkp1 = d21 * (d11 * a0 - a1), d21 * (d22 * a1 - a0)
    w2 = w - jnp.outer(a0, wk) - jnp.outer(a1, wkp1)
    block = jnp.where(rows == k, w[k, k], jnp.where(rows == k + 1, w[k + 1, k], 0))
    ld2 = ld.at[:, k].set(jnp.where(rows > k + 1, wk, block))
    ld2 = ld2.at[:, k + 1].set(jnp.where(rows > k + 1, wkp1, jnp.where(rows == k + 1, w[k + 1, k + 1], 0)))
    w = jnp.where(single, w1, w2)
    w = jnp.tril(w) + jnp.tril(w, -1).T  # LAPACK reads and writes the lower triangle only
    ld = jnp.where(single, ld1, ld2)
    pivot = (kp + 1).astype(np.int32)
    pivots = jnp.where(single, pivots.at[k].set(pivot),
                       pivots.at[k].set(-pivot).at[jnp.minimum(k + 1, n - 1)].set(-pivot))
    info = jnp.where((info == 0) & zero, k + 1, info).astype(np.int32)
    return w, ld, pivots, k + jnp.where(single, 1, 2), info


def _ldl_factor(a):
    n = a.shape[-1]
    sym = jnp.tril(a) + jnp.tril(a, -1).T
    state = (sym, jnp.zeros_like(a), jnp.zeros(n, np.int32), jnp.int32(0), jnp.int32(0))
    _, ld, pivots, _, info = lax.while_loop(lambda s: s[3] < n, _ldl_step, state)
    return ld, pivots, info


def _batched(fn, *args, batch_dims: int):
    """fn over the last (non-batch) dims, vmapped over `batch_dims` leading dims."""
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn(*args)


@registry.register(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(ctx, a, *, hermitian=False, check_errors=False):
    # Real matrices: hermitian and symmetric factorisations coincide.
    if a.shape[-1] == 0:
        return a, jnp.zeros(a.shape[:-1], np.int32), jnp.zeros(a.shape[:-2], np.int32)
    return _batched(_ldl_factor, a, batch_dims=a.ndim - 2)


def _ldl_solve(ld, pivots, b):
    """LAPACK's sytrs (lower): L D L^T X = B through the pivot sequence, forward then back."""
    n = ld.shape[-1]
    rows = jnp.arange(n)

    def swap(x, i, j):
        order = rows.at[i].set(j).at[j].set(i)
        return x[order]

    def forward(state):
        x, k = state
        single = pivots[k] > 0
        kp = jnp.abs(pivots[k]) - 1
        kk = jnp.where(single, k, k + 1)
        x = swap(x, kk, kp)
        column0 = jnp.where(rows > kk, ld[:, k], 0)
        column1 = jnp.where(rows > k + 1, ld[:, jnp.minimum(k + 1, n - 1)], 0)
        x1 = (x - column0[:, None] * x[k]).at[k].divide(ld[k, k])
        x2 = x - column0[:, None] * x[k] - column1[:, None] * x[jnp.minimum(k + 1, n - 1)]
        akm1k = ld[jnp.minimum(k + 1, n - 1), k]
        akm1, ak = ld[k, k] / akm1k, ld[jnp.minimum(k + 1, n - 1), jnp.minimum(k + 1, n - 1)] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = x2[k] / akm1k, x2[jnp.minimum(k + 1, n - 1)] / akm1k
        x2 = x2.at[k].set((ak * bkm1 - bk) / denom)
        x2 = x2.at[jnp.minimum(k + 1, n - 1)].set((akm1 * bk - bkm1) / denom)
        return jnp.where(single, x1, x2), k + jnp.where(single, 1, 2)

    def backward(state):
        x, k = state
        single = pivots[k] > 0
        first = jnp.where(single, k, k - 1)  # the block's first column
        column = jnp.where(rows > k, ld[:, k], 0)
        x = x.at[k].add(-(column @ x))
        previous = jnp.where(rows > k, ld[:, jnp.maximum(k - 1, 0)], 0)
        x = jnp.where(single, x, x.at[first].add(-(previous @ x)))
        x = swap(x, k, jnp.abs(pivots[k]) - 1)
        return x, k - jnp.where(single, 1, 2)

    x, _ = lax.while_loop(lambda s: s[1] < n, forward, (b, jnp.int32(0)))
    x, _ = lax.while_loop(lambda s: s[1] >= 0, backward, (x, jnp.int32(n - 1)))
    return x


@registry.register(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(ctx, ld, pivots, b, *, hermitian=False):
    ld, b = _broadcast_batch(ld, b)
    pivots = jnp.broadcast_to(pivots, ld.shape[:-1])
    return _batched(_ldl_solve, ld, pivots, b, batch_dims=ld.ndim - 2)
