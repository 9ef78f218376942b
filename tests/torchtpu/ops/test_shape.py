"""Shape ops (`torchtpu/ops/shape.py`) and view lowerings (`torchtpu/ops/views.py`) on `tpu`,
against PyTorch's CPU kernels: concatenation with promotion and legacy empty tensors, every
padding mode (negative amounts, backward), flips, rolls, repeats, triangles, diagonal embedding,
the `*_scatter` ops, the views' backward ops, and every view as a function of values (through
its `*_copy` overload, or called directly through the registry for the views whose eager kernels
only set metadata).

(View lowerings are tested here: `tests/torchtpu/test_views.py`, the eager aliasing suite, owns
the module name `test_views`.)
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import torchtpu
from torchtpu.ops import registry
from torchtpu.ops.schema import signature

from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops  # noqa: F401

aten = torch.ops.aten

X = torch.randn(3, 4, 5)
NONCONTIGUOUS = torch.randn(5, 4, 3).permute(2, 1, 0)


# --- cat ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensors, dim",
    [
        ([X, torch.randn(3, 2, 5)], 1),
        ([X, NONCONTIGUOUS], -1),
        ([X, torch.ones(3, 4, 1, dtype=torch.int64)], 2),  # float32 wins over int64
        ([torch.ones(2, dtype=torch.int32), torch.tensor([True, False])], 0),  # int32 wins over bool
        ([X, torch.randn(0), X], 0),  # 1-D empty tensors are skipped whatever their rank
        ([torch.randn(0), torch.randn(0)], 0),
        ([torch.randn(2, 0, 3), torch.randn(2, 2, 3)], 1),
        ([X.to(torch.bfloat16), X.to(torch.bfloat16)], 0),
    ],
)
def test_cat(tensors, dim):
    same_as_cpu(lambda *ts: torch.cat(ts, dim), *tensors)


def test_cat_out_resizes_and_casts():
    def cat_into(a, b, out):
        torch.cat([a, b], 0, out=out)
        return out

    same_as_cpu(cat_into, X, X, torch.empty(0, dtype=torch.float64))


def test_cat_error_names_the_mismatch():
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([X.to("tpu"), torch.randn(3, 5, 5).to("tpu")], 2)


# --- padding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pad, value",
    [((1, 2), 0.0), ((1, -1, 2, 0), 3.5), ((-2, -1, 0, 0, 1, 1), -1.0), ((0, 0), 0.0)],
)
def test_constant_pad(pad, value):
    same_as_cpu(lambda x: F.pad(x, pad, value=value), X)
    same_as_cpu(lambda x: F.pad(x, pad, value=value), X.to(torch.int64))


def test_constant_pad_casts_the_value_to_the_dtype():
    same_as_cpu(lambda x: aten.constant_pad_nd(x, [1, 1], 2.75), torch.arange(4))


PADS = [
    ("reflect", (2, 1), (2, 3, 6)),
    ("reflect", (1, 2, 2, 0), (2, 3, 4, 5)),
    ("reflect", (1, 1, 0, 2, 2, 1), (1, 2, 3, 4, 5)),
    ("reflect", (-1, 2), (2, 3, 6)),
    ("replicate", (3, 0), (2, 3, 2)),
    ("replicate", (1, 2, -1, 3), (1, 2, 4, 4)),
    ("replicate", (-4, 5), (1, 2, 4)),  # crops away the whole input: every output copies x[3]
    ("replicate", (1, 0, 2, 0, 0, 3), (1, 2, 3, 4, 2)),
]


@pytest.mark.parametrize("mode, pad, shape", PADS)
def test_mode_pad(mode, pad, shape):
    x = torch.randn(shape)
    same_as_cpu(lambda t: F.pad(t, pad, mode=mode), x)
    grads_same_as_cpu(lambda t: F.pad(t, pad, mode=mode), x)


def test_circular_pad_decomposes_onto_lowered_ops():
    same_as_cpu(lambda t: F.pad(t, (2, 1, 1, 1), mode="circular"), torch.randn(1, 2, 3, 4))


# --- reorderings and repeats ------------------------------------------------------------------


CASES = {
    "flip": (lambda x: x.flip(0, -1), X),
    "flip_none": (lambda x: torch.flip(x, ()), X),
    "flip_0d": (lambda x: x.flip(()), torch.tensor(3.0)),
    "flip_noncontiguous": (lambda x: x.flip(1), NONCONTIGUOUS),
    "roll_dims": (lambda x: x.roll((1, -2), (0, 2)), X),
    "roll_flat": (lambda x: x.roll(7), X),
    "roll_noncontiguous": (lambda x: x.roll(-1, 0), NONCONTIGUOUS),
    "roll_empty": (lambda x: x.roll(2, 0), torch.randn(0, 3)),
    "repeat": (lambda x: x.repeat(2, 1, 1, 3), X),
    "repeat_zero": (lambda x: x.repeat(0, 2, 1), X),
    "repeat_0d": (lambda x: x.repeat(2, 3), torch.tensor(1.5)),
    "repeat_bool": (lambda x: x.repeat(2, 2), torch.tensor([[True, False]])),
    "tril": (lambda x: x.tril(1), X),
    "triu_negative": (lambda x: x.triu(-2), X),
    "triu_int": (lambda x: x.triu(), torch.arange(12).reshape(3, 4)),
    "tril_bool_noncontiguous": (lambda x: (x > 0).tril(-1), NONCONTIGUOUS),
    "diag_embed": (lambda x: torch.diag_embed(x), X),
    "diag_embed_offset": (lambda x: torch.diag_embed(x, 2, 0, 2), X),
    "diag_embed_negative_offset": (lambda x: torch.diag_embed(x, -1, -1, 1), X),
    "diag_embed_nan_stays_on_diagonal": (lambda x: torch.diag_embed(x), torch.tensor([float("nan"), 1.0])),
    "clone": (lambda x: x.clone(), NONCONTIGUOUS),
    "clone_bf16": (lambda x: x.clone(), X.to(torch.bfloat16)),
}


@pytest.mark.parametrize("name", CASES)
def test_shape_op(name):
    fn, x = CASES[name]
    same_as_cpu(fn, x)


def test_clone_keeps_the_memory_format():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert x.to("tpu").clone().stride() == x.clone().stride()
    assert x.to("tpu").clone(memory_format=torch.contiguous_format).stride() == (60, 20, 5, 1)


# --- scatters into views, views' backward ops ------------------------------------------------


SCATTERS = {
    "select": (lambda x, s: torch.select_scatter(x, s, 1, -1), torch.randn(3, 5)),
    "select_0": (lambda x, s: torch.select_scatter(x, s, 0, 0), torch.randn(4, 5)),
    "slice_step": (lambda x, s: torch.slice_scatter(x, s, 2, 1, None, 2), torch.randn(3, 4, 2)),
    "slice_clamped": (lambda x, s: torch.slice_scatter(x, s, 1, -2, 100), torch.randn(3, 2, 5)),
    "slice_whole": (lambda x, s: torch.slice_scatter(x, s), torch.randn(3, 4, 5)),
    "diagonal": (lambda x, s: torch.diagonal_scatter(x, s, 1, 1, 2), torch.randn(3, 4)),
    "diagonal_negative": (lambda x, s: torch.diagonal_scatter(x, s, -1, 2, 0), torch.randn(4, 3)),
    "as_strided": (lambda x, s: torch.as_strided_scatter(x, s, (3, 4), (10, 2), 1), torch.randn(3, 4)),
    "as_strided_no_offset": (lambda x, s: torch.as_strided_scatter(x, s, (2, 5), (1, 12)), torch.randn(2, 5)),
}


@pytest.mark.parametrize("name", SCATTERS)
def test_scatter_into_view(name):
    fn, src = SCATTERS[name]
    same_as_cpu(fn, X, src)
    same_as_cpu(fn, X.to(torch.int64), src.to(torch.int64))


def test_select_scatter_bool():
    same_as_cpu(lambda x, s: torch.select_scatter(x, s, 0, 1), X > 0, torch.ones(4, 5, dtype=torch.bool))


def test_as_strided_scatter_follows_the_input_layout_as_pytorchs_kernel():
    """PyTorch's kernel writes into a copy of the input that keeps its strides (a contiguous
    copy of an input that overlaps itself); a view that reads an element twice is refused."""
    scatter = torch.as_strided_scatter
    same_as_cpu(lambda x, s: scatter(x, s, (2, 3), (1, 2), 2), torch.arange(12.0).view(3, 4).t(), -torch.ones(2, 3))
    same_as_cpu(lambda x, s: scatter(x, s, (2,), (2,)), torch.arange(3).expand(2, 3), torch.tensor([-1, -2]))
    same_as_cpu(lambda x, s: scatter(x, s, (2,), (2,), 1), torch.ones(4, dtype=torch.bool),
                torch.zeros(2, dtype=torch.bool))
    same_as_cpu(lambda x, s: scatter(x, s, (0, 3), (1, 1)), torch.arange(4.0), torch.empty(0, 3))
    with pytest.raises(ValueError, match="refers to some storage elements more than once"):
        scatter(torch.arange(6.0).to("tpu"), torch.ones(2, 2).to("tpu"), (2, 2), (1, 1))


def test_writes_into_an_as_strided_view_compile_into_the_program():
    """Functionalization turns a write into an `as_strided` view into `as_strided_scatter`: it
    runs inside the compiled program (it split the graph)."""

    def fn(x):
        y = x.clone()
        y.as_strided((2, 2), (1, 3), 1).mul_(2)
        return y

    x = torch.randn(12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        out = torch.compile(fn, backend="tpu")(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), fn(x), rtol=0, atol=0)
    assert "compiled_graphs_split" not in torchtpu.metrics()


VIEW_GRADS = {
    "select": lambda x: x[:, -1],
    "slice": lambda x: x[1:, ::2, -3:],
    "diagonal": lambda x: x.diagonal(1, 0, 2),
    "unfold_overlapping": lambda x: x.unfold(2, 3, 1),
    "unfold_gaps": lambda x: x.unfold(1, 1, 2),
}


@pytest.mark.parametrize("name", VIEW_GRADS)
def test_view_backward(name):
    grads_same_as_cpu(VIEW_GRADS[name], X)


@pytest.mark.parametrize(
    "op, grad, args",
    [
        (aten.select_backward, (3, 5), ([3, 4, 5], 1, -2)),
        (aten.slice_backward, (3, 4, 2), ([3, 4, 5], 2, 1, 4, 2)),
        (aten.diagonal_backward, (3, 4), ([3, 4, 5], -1, 2, 1)),
        (aten.unfold_backward, (3, 4, 4, 2), ([3, 4, 5], 2, 2, 1)),
    ],
)
def test_view_backward_ops_directly(op, grad, args):
    same_as_cpu(lambda g: op(g, *args), torch.randn(grad))


# --- views as functions of values ----------------------------------------------------------------


COPY_VIEWS = {
    "permute_copy": lambda x: torch.permute_copy(x, (2, 0, -2)),
    "transpose_copy": lambda x: torch.transpose_copy(x, 0, -1),
    "t_copy": lambda x: torch.t_copy(x[0]),
    "expand_copy": lambda x: torch.expand_copy(x[:, :1], (2, -1, 4, 5)),
    "slice_copy_step": lambda x: aten.slice_copy(x, 1, 1, None, 2),
    "slice_copy_negative_bounds": lambda x: aten.slice_copy(x, -1, -4, -1),
    "slice_copy_clamped": lambda x: aten.slice_copy(x, 0, -100, 100),
    "slice_copy_empty": lambda x: aten.slice_copy(x, 2, 4, 1),
    "select_copy_negative": lambda x: torch.select_copy(x, 1, -1),
    "squeeze_copy": lambda x: torch.squeeze_copy(x[:, :1, None]),
    "squeeze_copy_dim": lambda x: torch.squeeze_copy(x[:, :1], 1),
    "squeeze_copy_dims": lambda x: torch.squeeze_copy(x[:1, :1], (0, 1, 2)),
    "unsqueeze_copy_negative": lambda x: torch.unsqueeze_copy(x, -2),
    "diagonal_copy": lambda x: torch.diagonal_copy(x, -1, 2, 0),
    "alias_copy": torch.alias_copy,
    "detach_copy": torch.detach_copy,
    "lift_fresh_copy": aten.lift_fresh_copy,
    "split_copy_uneven": lambda x: torch.split_copy(x, 2, -1),
    "split_with_sizes_copy": lambda x: torch.split_with_sizes_copy(x, [1, 0, 3], 1),
    "unbind_copy": lambda x: torch.unbind_copy(x, 2),
    "view_copy": lambda x: torch.view_copy(x.contiguous(), (-1, 10)),
    "reshape_alias_copy": lambda x: aten._reshape_alias_copy(x.contiguous(), (12, 5), (5, 1)),
    "unsafe_view": lambda x: aten._unsafe_view(x.contiguous(), (4, 15)),
    "unfold_copy": lambda x: torch.unfold_copy(x, 1, 2, 1),
    "view_copy_dtype_narrower": lambda x: aten.view_copy.dtype(x.contiguous(), torch.int16),
    "view_copy_dtype_wider": lambda x: aten.view_copy.dtype(x[..., :4].contiguous().to(torch.int16), torch.float32),
    "view_copy_dtype_same_size": lambda x: aten.view_copy.dtype(x.contiguous(), torch.int32),
}


@pytest.mark.parametrize("name", COPY_VIEWS)
def test_view_copy(name):
    same_as_cpu(COPY_VIEWS[name], X)
    same_as_cpu(COPY_VIEWS[name], NONCONTIGUOUS.reshape(3, 4, 5))


def test_view_copy_bool_and_bf16():
    same_as_cpu(lambda x: torch.permute_copy(x, (1, 0, 2)), X > 0)
    same_as_cpu(lambda x: torch.split_copy(x, 3, 1), X.to(torch.bfloat16))


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s sizes, strides and storage offset."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="meta")
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())


def lowered(op, *args, **kwargs):
    """`op`'s registered lowering applied to CPU tensors' values, with a context of meta tensors."""
    sig = signature(op)
    values = sig.normalize(args, kwargs)
    meta = [tree_map(lambda v: _meta(v) if isinstance(v, torch.Tensor) else v, v) for v in values]
    pos, kw = sig.split(meta)
    ctx = registry.LoweringContext(op, meta, op(*pos, **kw))
    arrays = [tree_map(lambda v: jnp.asarray(v.numpy()) if isinstance(v, torch.Tensor) else v, v) for v in values]
    pos, kw = sig.split(arrays)
    return torch.from_numpy(np.array(registry.get(op).fn(ctx, *pos, **kw)))


@pytest.mark.parametrize(
    "op, x, args",
    [
        (aten.view.default, X, ((-1, 4),)),
        (aten._reshape_alias.default, X, ((4, 15), (15, 1))),
        (aten.unfold.default, X, (2, 3, 2)),
        (aten.unfold.default, torch.tensor(2.0), (0, 1, 1)),
        (aten.as_strided.default, X, ((3, 3), (7, 2), 4)),
        (aten.as_strided.default, X, ((2, 2, 2), (0, 1, 20), None)),
        (aten.as_strided.default, X[1:], ((2, 3), (1, 5), 25)),  # offset counts in the storage
        (aten.as_strided.default, X.transpose(0, 2), ((4, 4), (5, 1), None)),  # dense: its run
    ],
)
def test_metadata_view_lowerings(op, x, args):
    """Views whose eager kernels only set metadata, called as functions of values (as compiled
    graphs call them), against the CPU view's values."""
    torch.testing.assert_close(lowered(op, x, *args), op(x, *args).contiguous(), rtol=0, atol=0)


def test_as_strided_lowering_refuses_what_the_value_cannot_tell():
    with pytest.raises(ValueError, match="needs a dense input"):
        lowered(aten.as_strided.default, X[:, ::2], (2, 2), (1, 1))
    with pytest.raises(ValueError, match=r"reads storage elements \[5, 62\], outside the input's \[0, 60\)"):
        lowered(aten.as_strided.default, X, (2, 2), (1, 56), 5)
