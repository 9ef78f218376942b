"""Indexing (`torchtpu/ops/indexing.py`) and embedding (`torchtpu/ops/embedding.py`) lowerings
on `tpu`, against PyTorch's CPU kernels: gather/scatter with every reduction, advanced indexing
and `index_put` (including boolean masks), `index_select`/`index_reduce`, masked ops, `put`/`take`,
embedding lookups and bags with their gradients, in-place and `out=` forms, bf16 and int64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import torchtpu
from torchtpu.exec.checks import DeviceCheckError

from cpu_reference import grads_same_as_cpu, same_as_cpu, strict_ops, to  # noqa: F401

aten = torch.ops.aten

X = torch.randn(3, 4, 5)
XI = torch.randint(-50, 50, (3, 4, 5))
NONCONTIGUOUS = torch.randn(5, 4, 3).permute(2, 1, 0)


# --- gather / scatter ------------------------------------------------------------------------------


GATHERS = {
    "dim0": (0, torch.randint(0, 3, (2, 4, 5))),
    "negative_dim_smaller_index": (-1, torch.randint(0, 5, (2, 3, 7))),
    "empty_index": (1, torch.zeros(3, 0, 5, dtype=torch.int64)),
}


@pytest.mark.parametrize("name", GATHERS)
def test_gather(name):
    dim, index = GATHERS[name]
    for x in (X, XI, NONCONTIGUOUS, X.to(torch.bfloat16)):
        same_as_cpu(lambda t, i: torch.gather(t, dim, i), x, index)


def test_gather_0d_and_out():
    same_as_cpu(lambda t, i: torch.gather(t, 0, i), torch.tensor(2.5), torch.tensor(0))

    def into(t, i, out):
        return torch.gather(t, 1, i, out=out)

    same_as_cpu(into, X, torch.randint(0, 4, (3, 2, 5)), torch.empty(3, 2, 5))


@pytest.mark.parametrize("mode", ["strict", "debug", "defer"])
@pytest.mark.parametrize(
    "name, op",
    [
        ("gather", lambda x, i: torch.gather(x, 0, i)),
        ("index_select", lambda x, i: x.index_select(0, i)),
        ("scatter", lambda x, i: torch.zeros(4, device="tpu").scatter(0, i, torch.ones(3, device="tpu"))),
        ("index", lambda x, i: x[i]),
        ("index_put", lambda x, i: x.index_put((i,), torch.ones(3, device="tpu"))),
        ("embedding", lambda x, i: torch.nn.functional.embedding(i, x.view(4, 1))),
    ],
)
def test_out_of_range_indices_raise_at_the_next_sync(name, op, mode):
    """As PyTorch raises (and CUDA reports device-side asserts at the next sync), an index out of
    range is an error naming the op; nothing is dropped or clamped silently."""
    x = torch.arange(4.0).to("tpu")
    index = torch.tensor([1, 4, 0]).to("tpu")
    with torchtpu.eager_mode(mode), pytest.raises(DeviceCheckError, match=f"aten.{name}.*index out of range"):
        op(x, index).cpu()
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]  # the error was reported once; work goes on


INDEX = torch.tensor([[[0, 1, 2, 1, 0]], [[2, 2, 1, 0, 1]]])  # (2, 1, 5): duplicates along dim 0


def test_scatter_src_value_and_legacy_reduce():
    unique = torch.tensor([[[0, 1, 2, 1, 0]], [[2, 0, 1, 0, 1]]])[:1]
    src = torch.randn(2, 2, 5)
    same_as_cpu(lambda x, i, s: x.scatter(0, i, s), X, unique, src)
    same_as_cpu(lambda x, i: x.scatter(0, i, -2.5), X, unique)
    same_as_cpu(lambda x, i: x.scatter(0, i, 7), XI, unique)
    same_as_cpu(lambda x, i, s: x.scatter(0, i, s, reduce="add"), X, INDEX, src, exact=False)
    same_as_cpu(lambda x, i, s: x.scatter(0, i, s, reduce="multiply"), X, INDEX, src, exact=False)
    same_as_cpu(lambda x, i: x.scatter(0, i, 3.0, reduce="multiply"), X, INDEX, exact=False)


def test_scatter_in_place_and_bool():
    def scatter_(x, i, s):
        x = x.clone()
        x.scatter_(2, i, s)
        return x

    same_as_cpu(scatter_, X, torch.tensor([[[4, 0]]]), torch.randn(1, 1, 2))
    same_as_cpu(scatter_, X > 0, torch.tensor([[[4, 0]]]), torch.ones(1, 1, 2, dtype=torch.bool))


def test_scatter_add():
    src = torch.randn(2, 3, 5)
    same_as_cpu(lambda x, i, s: x.scatter_add(0, i, s), X, INDEX, src, exact=False)
    same_as_cpu(lambda x, i, s: x.scatter_add(0, i, s), XI, INDEX, src.to(torch.int64) * 10)
    same_as_cpu(lambda x, i, s: x.scatter_add(0, i, s), X.bfloat16(), INDEX, src.bfloat16(), exact=False)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    def fn(x, i, s):
        return x.scatter_reduce(0, i, s, reduce, include_self=include_self)

    same_as_cpu(fn, X, INDEX, torch.randn(2, 2, 5), exact=False)
    same_as_cpu(fn, XI, INDEX, torch.randint(-9, 9, (2, 2, 5)))  # integer mean floors


def test_scatter_reduce_nan_and_in_place():
    x = torch.tensor([1.0, float("nan"), 3.0, 0.0])
    src = torch.tensor([float("nan"), 2.0, 5.0])
    index = torch.tensor([0, 1, 2])
    for reduce in ("amax", "amin", "sum"):
        same_as_cpu(lambda t, i, s: t.clone().scatter_reduce_(0, i, s, reduce), x, index, src)


# --- advanced indexing --------------------------------------------------------------------------------


def on(x: torch.Tensor, *tensors: torch.Tensor):
    """`tensors` on `x`'s device (PyTorch's CUDA kernels also take CPU indices; see the report)."""
    moved = tuple(t.to(x.device) if isinstance(t, torch.Tensor) else t for t in tensors)
    return moved if len(moved) > 1 else moved[0]


INDEXING = {
    "one_dim": lambda x: x[on(x, torch.tensor([2, 0, -1]))],
    "two_broadcast": lambda x: x[on(x, torch.tensor([0, -1])), :, on(x, torch.tensor([[1], [4]]))],
    "adjacent_after_slice": lambda x: x[:, on(x, torch.tensor([0, 3])), on(x, torch.tensor([1, 4]))],
    "separated_move_to_front": lambda x: x[on(x, torch.tensor([1, 2])), :, on(x, torch.tensor([0, 3]))],
    "0d_index": lambda x: x[:, on(x, torch.tensor(2))],
    "int32_index": lambda x: x[on(x, torch.tensor([1, 1], dtype=torch.int32))],
    "empty_index": lambda x: x[on(x, torch.zeros(0, dtype=torch.int64))],
    "with_basic_slices": lambda x: x[1:, on(x, torch.tensor([[0], [2]])), ::2],
}


@pytest.mark.parametrize("name", INDEXING)
def test_index(name):
    for x in (X, XI, NONCONTIGUOUS, X > 0):
        same_as_cpu(INDEXING[name], x)


def test_index_with_bool_mask():
    same_as_cpu(lambda x, m: x[m], X, X[..., 0] > 0)


def test_cpu_index_tensors_are_accepted():
    # As with CUDA tensors, advanced indices may stay on the CPU.
    idx = torch.tensor([1, 0])
    same_as_cpu(lambda x: x[idx], X)
    same_as_cpu(lambda x: x[X[..., 0] > 0], X)


def _put(indices, values, accumulate=False):
    def fn(x):
        return aten.index_put(x, [on(x, i) for i in indices], on(x, values), accumulate)

    return fn


INDEX_PUTS = {
    "rows": _put((torch.tensor([0, 2]),), torch.randn(2, 4, 5)),
    "broadcast_value": _put((torch.tensor([-1]), None, torch.tensor([0, 4])), torch.randn(1)),
    "accumulate_duplicates": _put((torch.tensor([0, 0, 2]),), torch.randn(4, 5), accumulate=True),
    "mask_scalar": _put((torch.rand(3, 4) > 0.5,), torch.tensor(7.0)),
    "mask_every_value": _put((torch.tensor([[True, False, True, True]] * 3),), torch.arange(45.0).reshape(9, 5)),
    "mask_after_slice": _put((None, torch.tensor([False, True, True, False])), torch.randn(3, 1, 5)),
    "mask_values_along_selection": _put((None, torch.tensor([True, False, True, False])), torch.randn(2, 5)),
    "mask_accumulate": _put((torch.rand(3, 4, 5) > 0.5,), torch.tensor(1.5), accumulate=True),
    "mask_all_false": _put((torch.zeros(3, dtype=torch.bool),), torch.randn(4, 5), accumulate=True),
}


@pytest.mark.parametrize("name", INDEX_PUTS)
def test_index_put(name):
    same_as_cpu(INDEX_PUTS[name], X, exact=False)


def test_setitem_and_in_place_forms():
    def setitem(x, i, v):
        x = x.clone()
        x[:, i] = v
        x[x > 1] = 0
        return x

    same_as_cpu(setitem, X, torch.tensor([1, 3]), torch.randn(3, 2, 5))
    same_as_cpu(setitem, XI, torch.tensor([1, 3]), torch.tensor(5))

    def impl(x, i, v):
        x = x.clone()
        aten._index_put_impl_(x, (i,), v, accumulate=True, unsafe=True)
        return x

    same_as_cpu(impl, X, torch.tensor([2, 2, 0]), torch.ones(3, 4, 5), exact=False)


def test_index_put_bad_mask_shape_names_both_shapes():
    x = X.to("tpu")
    with pytest.raises(IndexError, match=r"mask \[4\] at index 0 does not match .* \[3, 4, 5\]"):
        x.index_put((torch.ones(4, dtype=torch.bool).to("tpu"),), torch.tensor(1.0).to("tpu"))


# --- index_select, index_reduce and the decomposed index_* ops -------------------------------


def test_index_select():
    index = torch.tensor([3, 0, 0])
    for x in (X, XI, NONCONTIGUOUS, X.bfloat16()):
        same_as_cpu(lambda t, i: t.index_select(1, i), x, index)
    same_as_cpu(lambda t, i: t.index_select(0, i), torch.tensor(1.5), torch.tensor([0]))
    same_as_cpu(lambda t, i: t.index_select(-1, i), X, torch.tensor(4))
    same_as_cpu(lambda t, i, o: torch.index_select(t, 2, i, out=o), X, index, torch.empty(0))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    index = torch.tensor([0, 3, 0, 1])

    def fn(x, s):
        return x.index_reduce(1, on(x, index), s, reduce, include_self=include_self)

    same_as_cpu(fn, X, torch.randn(3, 4, 5), exact=False)
    same_as_cpu(fn, XI, torch.randint(-9, 9, (3, 4, 5)))


def test_index_add_copy_fill():
    index = torch.tensor([2, 0])
    same_as_cpu(lambda x, s: x.index_add(1, on(x, index), s, alpha=-2), X, torch.randn(3, 2, 5), exact=False)
    same_as_cpu(lambda x, s: x.index_copy(2, on(x, index), s), XI, torch.randint(0, 9, (3, 4, 2)))
    same_as_cpu(lambda x: x.index_fill(0, on(x, index), -1.5), X)
    same_as_cpu(lambda x, v: x.clone().index_fill_(-1, on(x, index), v), X, torch.tensor(4.0))


# --- masks, put and take ------------------------------------------------------------------------------


MASK = torch.rand(4, 5) > 0.5


def test_masked_fill():
    same_as_cpu(lambda x, m: x.masked_fill(m, -1.5), X, MASK)
    same_as_cpu(lambda x, m, v: x.masked_fill(m, v), XI, MASK, torch.tensor(3))
    same_as_cpu(lambda x, m: x.masked_fill(m, 2.7), XI, MASK)  # the value is cast to int64
    same_as_cpu(lambda x, m: x.masked_fill(m, True), X > 0, MASK)
    same_as_cpu(lambda x, m: x.masked_fill(m, 1.0), torch.randn(5), MASK)  # broadcasts self
    same_as_cpu(lambda x, m: x.clone().masked_fill_(m, float("nan")), NONCONTIGUOUS, MASK)
    same_as_cpu(lambda x, m: x.masked_fill(m, 0.5), X.bfloat16(), MASK)


def test_masked_scatter():
    source = torch.randn(3, 4, 5)
    same_as_cpu(lambda x, m, s: x.masked_scatter(m, s), X, MASK, source)
    same_as_cpu(lambda x, m, s: x.clone().masked_scatter_(m, s), XI, MASK, XI.flip(0))
    same_as_cpu(lambda x, m, s: x.masked_scatter(m, s), torch.randn(5), MASK, source)
    same_as_cpu(lambda x, m, s: x.masked_scatter(m, s), X, torch.zeros(5, dtype=torch.bool), torch.randn(0))
    grads_same_as_cpu(lambda x, s: x.masked_scatter(on(x, MASK), s), X, source)


def test_put_and_take():
    index = torch.tensor([[0, -1], [5, 59]])
    same_as_cpu(lambda x, i: x.take(i), X, index)
    same_as_cpu(lambda x, i: x.take(i), torch.tensor(3), torch.tensor(0))
    same_as_cpu(lambda x, i, s: x.put(i, s), X, index, torch.randn(2, 2))
    same_as_cpu(lambda x, i, s: x.put(i, s, accumulate=True), XI, torch.tensor([3, 3, -60]), torch.tensor([1, 2, 3]))
    same_as_cpu(lambda x, i, s: x.clone().put_(i, s), NONCONTIGUOUS, index, torch.randn(4))


# --- embedding ---------------------------------------------------------------------------------------


WEIGHT = torch.randn(10, 3)
IDS = torch.tensor([[1, 2, 2], [9, 0, 2]])


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_embedding(padding_idx, scale_grad_by_freq):
    def fn(weight, ids):
        return F.embedding(ids, weight, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)

    same_as_cpu(fn, WEIGHT, IDS)
    same_as_cpu(fn, WEIGHT.bfloat16(), IDS)
    grads_same_as_cpu(fn, WEIGHT, IDS)


def test_embedding_max_norm_renormalises_referenced_rows_in_place():
    def fn(weight, ids):
        weight = weight.clone()
        out = F.embedding(ids, weight, max_norm=0.8, norm_type=1.5)
        return out, weight

    same_as_cpu(fn, WEIGHT, IDS, exact=False)


INDICES = torch.tensor([1, 2, 2, 5, 4, 3, 2, 9])
OFFSETS = torch.tensor([0, 3, 3, 6])  # bag 1 is empty


def _bag(mode, padding_idx=None, include_last_offset=False, per_sample_weights=False):
    offsets = torch.cat([OFFSETS, torch.tensor([8])]) if include_last_offset else OFFSETS

    def fn(weight, *psw):
        return F.embedding_bag(on(weight, INDICES), weight, on(weight, offsets), mode=mode,
                               padding_idx=padding_idx, include_last_offset=include_last_offset,
                               per_sample_weights=psw[0] if psw else None)

    return fn


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag(mode, padding_idx, include_last_offset):
    fn = _bag(mode, padding_idx, include_last_offset)
    same_as_cpu(fn, WEIGHT, exact=False)
    grads_same_as_cpu(fn, WEIGHT)


def test_embedding_bag_per_sample_weights_2d_input_and_bf16():
    fn = _bag("sum", padding_idx=5, per_sample_weights=True)
    same_as_cpu(fn, WEIGHT, torch.rand(8), exact=False)
    grads_same_as_cpu(fn, WEIGHT, torch.rand(8))
    same_as_cpu(lambda w, i: F.embedding_bag(i, w, mode="mean"), WEIGHT, torch.randint(0, 10, (3, 4)), exact=False)
    same_as_cpu(_bag("sum"), WEIGHT.bfloat16(), exact=False)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_without_indices(mode):
    def fn(weight):
        empty = torch.zeros(0, dtype=torch.int64).to(weight.device)
        return F.embedding_bag(empty, weight, on(weight, torch.tensor([0, 0])), mode=mode)

    same_as_cpu(fn, WEIGHT)
    grads_same_as_cpu(fn, WEIGHT)


def test_embedding_bag_max_indices_and_all_padding_bag():
    def fn(weight, ids, offsets):
        return aten._embedding_bag(weight, ids, offsets, False, 2, False, None, False, 2)[::3]

    same_as_cpu(fn, WEIGHT, torch.tensor([2, 2, 1, 4, 4]), torch.tensor([0, 2]))


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_scale_grad_by_freq(mode):
    """Reference: unbagged `F.embedding` on CPU, then each bag reduced -- PyTorch 2.13's CPU
    embedding_bag backward divides by the wrong count (pytorch/pytorch#190063)."""
    bags = torch.tensor([0, 0, 0, 2, 2, 2, 3, 3])

    def reference(weight):
        rows = F.embedding(INDICES, weight, scale_grad_by_freq=True)
        sums = torch.zeros(4, 3).index_add(0, bags, rows)
        return sums / torch.tensor([3.0, 1.0, 3.0, 2.0])[:, None] if mode == "mean" else sums

    def bagged(weight):
        return F.embedding_bag(INDICES.to("tpu"), weight, OFFSETS.to("tpu"), mode=mode, scale_grad_by_freq=True)

    cotangent = torch.linspace(-1, 2, 12).reshape(4, 3)
    weight = WEIGHT.clone().requires_grad_()
    (expected,) = torch.autograd.grad(reference(weight), weight, cotangent)
    weight = WEIGHT.to("tpu").requires_grad_()
    (actual,) = torch.autograd.grad(bagged(weight), weight, cotangent.to("tpu"))
    torch.testing.assert_close(actual.cpu(), expected)


def test_embedding_bag_sparse_gradient_is_refused():
    weight = WEIGHT.to("tpu").requires_grad_()
    out = F.embedding_bag(INDICES.to("tpu"), weight, OFFSETS.to("tpu"), sparse=True)
    with pytest.raises(ValueError, match="sparse gradients are not supported"):
        out.sum().backward()


def test_lowerings_inside_a_compiled_graph():
    """`torch.compile(backend="tpu")` runs these lowerings inside one program (no eager rerun)."""

    def fn(x, index, rows, weight, ids, offsets, mask):
        return (
            torch.gather(x, 1, index) * 2,
            x.scatter_add(0, index, torch.ones_like(index, dtype=x.dtype)),
            F.embedding_bag(ids, weight, offsets, mode="mean"),
            x.masked_fill(mask, 0.5),
            x.index_put((rows,), torch.tensor(3.0, device=x.device), accumulate=True),
        )

    args = (X[0], torch.randint(0, 4, (2, 3)), torch.tensor([2, 0, 2]), WEIGHT, INDICES, OFFSETS, MASK)
    eager_before = torchtpu.metrics().get("compiled_graphs_split", 0)
    actual = torch.compile(fn, backend="tpu")(*tree_map(to("tpu"), args))
    torch.testing.assert_close(tree_map(to("cpu"), actual), fn(*args))
    assert torchtpu.metrics().get("compiled_graphs_split", 0) == eager_before
