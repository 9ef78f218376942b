"""Softmax and normalisation layers on `tpu` against PyTorch's CPU kernels: dims (negative,
0-dim, empty), -inf rows, half_to_float and dtype arguments, bf16, layer/group/batch norm
forward and backward (affine or not, every output mask), running statistics updated in place,
and scaled-dot-product attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import torchtpu  # noqa: F401
from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops, to  # noqa: F401
from value_and_grad import Draws

aten = torch.ops.aten
DRAWS = Draws(0)
GEN, randn = DRAWS.generator, DRAWS.randn



# --- softmax ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax])
@pytest.mark.parametrize("shape, dim", [((3, 4, 5), 1), ((3, 4, 5), -1), ((), 0), ((0, 3), 1), ((4, 0), 0)])
def test_softmax(fn, shape, dim):
    same_as_cpu(lambda x: fn(x, dim), randn(*shape), exact=False)
    if math.prod(shape):
        grads_same_as_cpu(lambda x: fn(x, dim), randn(*shape))


def test_softmax_rows_of_minus_infinity_and_nan():
    x = torch.tensor([[-math.inf, -math.inf, -math.inf], [0.0, -math.inf, 1.0], [math.nan, 0.0, 1.0]])
    same_as_cpu(lambda v: torch.softmax(v, 1), x, exact=False)
    same_as_cpu(lambda v: torch.log_softmax(v, 1), x, exact=False)
    # _safe_softmax (attention with fully masked rows) gives 0 where softmax gives NaN.
    same_as_cpu(lambda v: aten._safe_softmax(v, 1), x[:2], exact=False)


def test_softmax_dtypes():
    x = randn(4, 6, dtype=torch.float32)
    same_as_cpu(lambda v: torch.softmax(v, 1, dtype=torch.float64), x, exact=False)
    same_as_cpu(lambda v: torch.log_softmax(v, 0), x.bfloat16(), exact=False)
    # half_to_float (a CUDA path, CPU lacks it): bf16 in, the float32 softmax of those values out.
    half_to_float = aten._softmax(x.bfloat16().to("tpu"), 1, True).cpu()
    torch.testing.assert_close(half_to_float, torch.softmax(x.bfloat16().float(), 1))
    same_as_cpu(lambda v: torch.softmax(v, -1, dtype=torch.float32), torch.arange(6).reshape(2, 3),
                exact=False)
    with pytest.raises(IndexError):
        torch.softmax(x.to("tpu"), 2)


def test_softmax_backward_ops():
    out, grad = torch.softmax(randn(3, 5), 1), randn(3, 5)
    same_as_cpu(lambda g, o: aten._softmax_backward_data(g, o, 1, torch.float64), grad, out,
                exact=False)
    same_as_cpu(lambda g, o: aten._log_softmax_backward_data(g, o, 0, torch.float64), grad,
                out.log(), exact=False)


# --- normalisation ----------------------------------------------------------------------------


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("normalized", [(5,), (4, 5)])
def test_layer_norm(affine, normalized):
    w = randn(*normalized) if affine else None
    b = randn(*normalized) if affine else None
    fn = lambda x, *wb: F.layer_norm(x, normalized, *wb, eps=1e-3)  # noqa: E731
    args = (randn(3, 4, 5),) + ((w, b) if affine else ())
    same_as_cpu(fn, *args, exact=False)
    grads_same_as_cpu(fn, *args)


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, True], [True, True, True]])
def test_norm_backward_output_masks(mask):
    x, w, b = randn(3, 4, 5), randn(5), randn(5)
    _, mean, rstd = aten.native_layer_norm(x, [5], w, b, 1e-5)
    same_as_cpu(lambda g, x, m, r, w, b: aten.native_layer_norm_backward(g, x, [5], m, r, w, b, mask),
                randn(3, 4, 5), x, mean, rstd, w, b, exact=False)
    x, w = randn(2, 6, 3, 2), randn(6)
    _, mean, rstd = aten.native_group_norm(x, w, w, 2, 6, 6, 3, 1e-5)
    same_as_cpu(lambda g, x, m, r, w: aten.native_group_norm_backward(g, x, m, r, w, 2, 6, 6, 3, mask),
                randn(2, 6, 3, 2), x, mean, rstd, w, exact=False)


@pytest.mark.parametrize("groups, shape", [(2, (3, 6, 4)), (3, (2, 6, 2, 3)), (1, (2, 4)), (4, (2, 4, 3))])
def test_group_norm(groups, shape):
    w, b = randn(shape[1]), randn(shape[1])
    fn = lambda x, w, b: F.group_norm(x, groups, w, b)  # noqa: E731
    same_as_cpu(fn, randn(*shape), w, b, exact=False)
    grads_same_as_cpu(fn, randn(*shape), w, b)


@pytest.mark.parametrize("training", [False, True])
def test_batch_norm(training):
    x, w, b = randn(4, 3, 5), randn(3), randn(3)
    rm, rv = randn(3), randn(3).abs() + 0.5
    fn = lambda x, w, b: F.batch_norm(x, rm.to(x.device), rv.to(x.device), w, b, training=training)  # noqa: E731
    same_as_cpu(fn, x, w, b, exact=False)
    grads_same_as_cpu(fn, x, w, b)
    grads_same_as_cpu(lambda x: F.batch_norm(x, None, None, training=True), randn(2, 3, 4, 2))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_updates_running_stats_in_place(momentum):
    cpu = torch.nn.BatchNorm2d(3, momentum=momentum).double()
    tpu = torch.nn.BatchNorm2d(3, momentum=momentum).double().to("tpu")
    for _ in range(3):
        x = randn(4, 3, 2, 2)
        cpu(x), tpu(x.to("tpu"))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(tpu, name).cpu(), getattr(cpu, name))
    cpu.eval(), tpu.eval()
    x = randn(4, 3, 2, 2)
    torch.testing.assert_close(tpu(x.to("tpu")).cpu(), cpu(x))


def test_eval_batch_norm_saves_no_statistics():
    """In eval mode ATen's CPU kernels return empty save_mean/save_invstd (PyTorch's meta kernel
    and decomposition say per-channel)."""
    draw = Draws(seed=5).randn  # its own draws: the module's stream stays as the other tests expect
    x, w, b, rm, rv = draw(4, 3, 5), draw(3), draw(3), draw(3), draw(3).abs() + 0.5
    for op in (aten.native_batch_norm, aten._native_batch_norm_legit):
        for training in (False, True):
            same_as_cpu(lambda *a: op(*a, training, 0.1, 1e-5), x, w, b, rm.clone(), rv.clone(), exact=False)


def test_batch_norm_ops():
    x, w, b, rm, rv = randn(4, 3, 5), randn(3), randn(3), randn(3), randn(3).abs() + 0.5
    same_as_cpu(lambda *a: aten._native_batch_norm_legit_functional(*a, True, 0.1, 1e-5),
                x, w, b, rm, rv, exact=False)
    same_as_cpu(lambda *a: aten._native_batch_norm_legit.no_stats(*a, True, 0.1, 1e-5), x, w, b,
                exact=False)
    same_as_cpu(lambda *a: aten._native_batch_norm_legit_no_training(*a, 0.1, 1e-5)[0],
                x, w, b, rm, rv, exact=False)
    _, save_mean, save_invstd = aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    for train in (False, True):
        same_as_cpu(lambda *a: aten.native_batch_norm_backward(*a, train, 1e-5, [True] * 3),
                    randn(4, 3, 5), x, w, rm, rv, save_mean, save_invstd, exact=False)


def _statistics_same_as_cpu(fn, *args) -> None:
    """`fn`'s outputs on `tpu` have CPU's dtypes and shapes, and its statistics outputs (all but
    the first) CPU's values. The normalised output is left to the other tests: with bf16
    parameters ATen's CPU batch norm rounds its per-channel scale and shift to bf16 before
    applying them, so where x is near the mean it is further from the float64 result than tpu
    (e.g. 0.0479 for 0.0434, tpu 0.0435)."""
    expected = fn(*args)
    actual = tree_map(to("cpu"), fn(*tree_map(to("tpu"), args)))
    assert [(t.dtype, t.shape) for t in actual] == [(t.dtype, t.shape) for t in expected]
    torch.testing.assert_close(actual[1:], expected[1:])


@pytest.mark.parametrize("params", [torch.bfloat16, torch.float32])
def test_saved_statistics_in_cpu_dtype(params):
    """ATen's CPU norm kernels save mean and rstd of a bf16 input in bf16, or in float32 when
    the parameters are float32; PyTorch's meta kernels say float32 always (and per-channel
    statistics in eval mode), as its CUDA kernels do."""
    draw = Draws(seed=7).randn  # its own draws: the module's stream stays as the other tests expect
    x = draw(4, 3, 5).bfloat16()
    w, b, rm, rv = (t.to(params) for t in (draw(3), draw(3), draw(3), draw(3).abs() + 0.5))
    _statistics_same_as_cpu(lambda *a: aten.native_layer_norm(*a, 1e-5), x, (5,),
                            *(t.to(params) for t in (draw(5), draw(5))))
    for training in (False, True):
        for op in (aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional):
            _statistics_same_as_cpu(lambda *a: op(*a, training, 0.1, 1e-5), x, w, b, rm.clone(), rv.clone())
    _statistics_same_as_cpu(lambda *a: aten._native_batch_norm_legit.no_stats(*a, True, 0.1, 1e-5), x, w, b)
    _statistics_same_as_cpu(lambda *a: aten._native_batch_norm_legit_no_training(*a, 0.1, 1e-5), x, w, b, rm, rv)
    _statistics_same_as_cpu(lambda *a: aten._batch_norm_with_update(*a, 0.1, 1e-5), x, w, b, rm.clone(), rv.clone())


def test_norms_in_bf16():
    x = randn(4, 6, 5, dtype=torch.float32).bfloat16()
    same_as_cpu(lambda v: F.layer_norm(v, (5,)), x, exact=False)
    same_as_cpu(lambda v: F.group_norm(v, 3), x, exact=False)
    same_as_cpu(lambda v: F.batch_norm(v, None, None, training=True), x, exact=False)


# --- attention --------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_dot_product_attention(causal):
    q, k, v = randn(2, 3, 5, 4), randn(2, 3, 6, 4), randn(2, 3, 6, 4)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    same_as_cpu(fn, q, k, v, exact=False)
    grads_same_as_cpu(fn, q, k, v)
    mask = torch.rand(5, 6, generator=GEN) > 0.3
    same_as_cpu(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                q, k, v, mask, exact=False)
