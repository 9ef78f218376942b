"""PyTorch's aliasing semantics on `tpu`: views share storage, in-place ops through any view are
visible in the base and every sibling view -- bit for bit as on CPU, in every eager mode."""

from __future__ import annotations

import pytest
import torch

import torchtpu

MODES = ["strict", "debug", "defer"]


def _base(device: str) -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(4, 12).to(device)


# Each pattern mutates through views of `x` (a 4x12 tensor) and returns tensors to compare.
PATTERNS = {
    "slice_add": lambda x: (x[1:3].add_(1), x),
    "step_slice_mul": lambda x: (x[:, ::3].mul_(2), x),
    "select_row": lambda x: (x[2].fill_(-1), x),
    "select_col": lambda x: (x[:, 5].fill_(7), x),
    "transpose_write": lambda x: (x.t()[3].add_(100), x),
    "view_flat": lambda x: (x.view(-1)[10:20].mul_(-1), x),
    "reshape_view": lambda x: (x.reshape(2, 24)[1].add_(0.5), x),
    "narrow": lambda x: (x.narrow(1, 2, 4).zero_(), x),
    "unsqueeze_write": lambda x: (x.unsqueeze(0)[0, 1].add_(3), x),
    "diagonal": lambda x: (x.diagonal().add_(1000), x),
    "diagonal_offset": lambda x: (x.diagonal(offset=2).fill_(-5), x),
    "permute_3d": lambda x: (x.view(4, 3, 4).permute(2, 0, 1)[1].mul_(3), x),
    "as_strided": lambda x: (x.as_strided((3, 3), (13, 1), 2).add_(9), x),
    "expand_read": lambda x: (x[0:1].expand(3, 12) + x[1:4], x),
    "sibling_views": lambda x: (_sibling(x), x),
    "view_of_view": lambda x: (x[1:][:, 2:][1:, ::2].add_(4), x),
    "copy_into_view": lambda x: (x[:, :3].copy_(x[:, 6:9]), x),
    "copy_broadcast": lambda x: (x[1:3].copy_(x[0]), x),
    "overlapping_read": lambda x: (x[:, 1:] + x[:, :-1], x),
    "chunk_write": lambda x: ([c.add_(i) for i, c in enumerate(x.chunk(3, dim=1))], x),
    "split_write": lambda x: ([c.mul_(i + 1) for i, c in enumerate(x.split([5, 7], dim=1))], x),
    "unbind_write": lambda x: ([r.add_(r[0].clone()) for r in x.unbind(0)], x),
    "squeeze_view": lambda x: (x[2:3].squeeze(0).add_(2), x),
    "t_contiguous_copy": lambda x: (x.t().contiguous().add_(1), x),
    "detach_shares": lambda x: (x.detach()[0].fill_(11), x),
    "data_shares": lambda x: (x.data[3].fill_(12), x),
    "view_after_inplace": lambda x: (_inplace_then_view(x), x),
    "inplace_on_base_seen_by_view": lambda x: (_base_then_view(x), x),
    "view_dtype_roundtrip": lambda x: (x.view(torch.int32)[0].add_(1), x),
    "unfold_read": lambda x: (x[0].unfold(0, 4, 2) * 1, x),
    "select_negative": lambda x: (x[-1, -1:].fill_(-3), x),
    "nested_transpose": lambda x: (x.view(4, 3, 4).transpose(0, 2).transpose(1, 2)[0, 1].add_(8), x),
    "zero_size_view": lambda x: (x[:, 5:5].add_(1), x),
    "scalar_view": lambda x: (x[1, 1].mul_(10), x),
}


def _sibling(x):
    a = x[:, :6]
    b = x[:, 3:9]
    a.add_(1)
    return b.clone()


def _inplace_then_view(x):
    x.mul_(2)
    return x[1:, 3:].clone()


def _base_then_view(x):
    v = x[::2, 1::2]
    x.add_(1)
    return v.clone()


def _to_cpu(out):
    if isinstance(out, torch.Tensor):
        return out.cpu()
    if isinstance(out, (list, tuple)):
        return type(out)(_to_cpu(o) for o in out)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (so -0.0 vs 0.0 or NaN payloads would count as differences)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(as_int)


def _assert_bitwise(a, b, path="out"):
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        assert torch.equal(_bits(a), _bits(b)), path
        return
    assert len(a) == len(b), path
    for i, (x, y) in enumerate(zip(a, b)):
        _assert_bitwise(x, y, f"{path}[{i}]")


def test_at_least_30_patterns():
    assert len(PATTERNS) >= 30


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_view_mutation_matches_cpu(name, mode):
    pattern = PATTERNS[name]
    expected = pattern(_base("cpu"))
    with torchtpu.eager_mode(mode):
        actual = _to_cpu(pattern(_base("tpu")))
    _assert_bitwise(actual, expected)


def test_views_share_storage_and_report_strides():
    x = _base("tpu")
    v = x.t()[1:, ::2]
    c = x.cpu().t()[1:, ::2]
    assert v.stride() == c.stride() and v.storage_offset() == c.storage_offset()
    assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert v._is_view() and v._base is x


def test_version_counter_and_autograd_view_tracking():
    x = _base("tpu").requires_grad_(True)
    y = x * 2
    v = y[1]
    before = y._version
    v.add_(1)
    assert y._version == before + 1
    y.sum().backward()
    assert torch.equal(x.grad.cpu(), torch.full((4, 12), 2.0))



def _tables_step(flat: torch.Tensor, rows: int, dim: int, tables: range) -> list[torch.Tensor]:
    """Table by table through a flat buffer of `[rows, dim]` tables (as TorchRec initialises
    tables that share one): in-place ops on each table's view, a read of it with table 1's
    view, and a sliding window of rows -- every view at a nonzero offset."""
    size = rows * dim
    out = []
    for i in tables:
        table = flat[i * size:(i + 1) * size].view(rows, dim)
        table.mul_(2).add_(i)
        out.append(table * 3 + flat[size:2 * size].view(rows, dim))
        out.append(flat.view(-1, dim)[i:i + 5] * 0.5 - 1)
    return out


def _programs(mode: str) -> int:
    counts = torchtpu.metrics()
    return counts.get("defer_compiles", 0) if mode == "defer" else counts.get("eager_programs", 0)


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_views_at_other_offsets_reuse_the_compiled_program(mode):
    """Once views of one geometry were seen at two offsets, such views take their offset at run
    time: tables 1-4 compile (a static program for the first offset, then the one taking it at
    run time; in defer mode a graph of each), tables 5-6 and 7-8 reuse those programs -- keyed
    by offset, every table would compile its own -- and every result is bit-equal to CPU."""
    rows, dim = 7, 3
    base = torch.arange(9 * rows * dim, dtype=torch.float32) / 7
    phases = [range(1, 3), range(3, 5), range(5, 7), range(7, 9)]
    cpu = base.clone()
    expected = [_tables_step(cpu, rows, dim, tables) for tables in phases]
    flat = base.to("tpu")
    actual, programs = [], []
    with torchtpu.eager_mode(mode):
        for tables in phases:
            actual.append(_tables_step(flat, rows, dim, tables))
            torch.tpu.synchronize()
            programs.append(_programs(mode))
    assert programs[1] == programs[2] == programs[3]
    _assert_bitwise(_to_cpu(actual), expected)
    _assert_bitwise(flat.cpu(), cpu)


def _nested_geometries(numel: int):
    """Every non-overlapping 2-d and 3-d (sizes, strides, offset) with gaps between rows or
    columns that fits in `numel` elements: regions inside one row of the storage seen as
    `[rows, outer stride]` and regions that wrap past a row's end."""
    for n0 in (1, 2, 3):
        for s0 in (5, 7, 12):
            for n1, s1 in ((2, 1), (3, 2), (2, 3)):
                for inner in ((), ((2, 1),)):
                    if inner and s1 < 2:
                        continue
                    sizes, strides = (n0, n1, *(n for n, _ in inner)), (s0, s1, *(s for _, s in inner))
                    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
                    if n1 * s1 > s0 or extent > numel:
                        continue
                    for offset in range(0, numel - extent + 1, 3):
                        yield sizes, strides, offset


def test_every_nested_region_reads_as_on_cpu():
    """Reads of regions with gaps (column blocks, selects of inner dims, step slices) equal CPU's,
    whether the region lies inside rows of its storage or wraps past a row's end."""
    base = torch.arange(40, dtype=torch.float32)
    device = base.to("tpu")
    geometries = list(_nested_geometries(base.numel()))
    assert len(geometries) > 100
    for sizes, strides, offset in geometries:
        expected = base.as_strided(sizes, strides, offset)
        actual = device.as_strided(sizes, strides, offset).cpu()
        assert torch.equal(actual, expected), (sizes, strides, offset)


def test_a_column_block_is_one_slice_of_its_storage():
    """A block of columns at an offset (`x[:, a:b]`, each value of TorchRec's
    `KeyedTensor.to_dict()`, every DLRM step) reads as one 2-D slice of the storage: no copy of
    the storage padded and shifted to the block's offset, as it was read before."""
    import jax
    import jax.numpy as jnp

    from torchtpu import strided

    rows, width, blocks = 16, 8, 6
    flat = jnp.arange(rows * width * blocks, dtype=jnp.float32)
    for k in range(blocks):
        geometry = strided.Geometry((rows, width), (blocks * width, 1), k * width)
        read = jax.jit(lambda f, g=geometry: strided.read(f, g))
        hlo = read.lower(flat).compile().as_text()
        assert "pad(" not in hlo and hlo.count("slice(") == 1, hlo
        assert (read(flat) == flat.reshape(rows, -1)[:, k * width : (k + 1) * width]).all()


@pytest.mark.parametrize("shared", [True, False])
def test_adjacent_column_views_join_back_into_their_tensor_within_one_trace(shared):
    """`cat` of a tensor's adjacent column blocks (TorchRec's `KeyedTensor.to_dict()` then `cat`)
    traced in one computation, as DeferAndFuse traces a graph, compiles to no slice and no
    concatenation: XLA sees one array's slices. Each read tracing its own reshape of the storage
    (outside `strided.one_trace`) leaves a slice per block and their concatenation."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from torchtpu import strided

    rows, width, blocks = 64, 16, 12
    geometries = [strided.Geometry((rows, width), (blocks * width, 1), k * width) for k in range(blocks)]

    def join(flat):
        with strided.one_trace() if shared else contextlib.nullcontext():
            return jnp.concatenate([strided.read(flat, g) for g in geometries], axis=1) * 2

    flat = jnp.arange(rows * width * blocks, dtype=jnp.float32)
    hlo = jax.jit(join).lower(flat).compile().as_text()
    assert ("concatenate" not in hlo and "slice(" not in hlo) == shared, hlo
    assert (join(flat) == 2 * flat.reshape(rows, blocks * width)).all()
