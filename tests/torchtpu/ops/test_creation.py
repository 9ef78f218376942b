"""Factory ops on `tpu` against PyTorch's CPU kernels: values, dtype inference from Scalar types,
explicit dtypes, degenerate sizes, memory formats of *_like ops, and out= variants."""

from __future__ import annotations

import pytest
import torch

import torchtpu  # noqa: F401
from test_reduction import strict_ops  # noqa: F401  (the autouse fixture)


def same_on_both(factory):
    """`factory(device)` on CPU and on `tpu`: equal values, dtype, shape and strides."""
    expected = factory("cpu")
    actual = factory("tpu")
    assert actual.device.type == "tpu"
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual.cpu(), expected, equal_nan=True)


ARANGE = [
    (5,), (2, 9), (9, 2, -2), (0.5, 3.0), (-1.0, 1.0, 0.1), (0, 1, 0.3), (3, 3),
    (1, 10**6, 7919), (-3.5, 3.5, 0.75),
]


@pytest.mark.parametrize("args", ARANGE, ids=str)
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.float64])
def test_arange(args, dtype):
    try:
        torch.arange(*args, dtype=dtype)
    except (RuntimeError, ValueError) as error:
        with pytest.raises(type(error)):
            torch.arange(*args, dtype=dtype, device="tpu")
        return
    # int32 with a step that truncates to 0 (0.3, 0.1): CPU computes it (every element is
    # `start`), though PyTorch's meta kernel rejects it.
    same_on_both(lambda device: torch.arange(*args, dtype=dtype, device=device))


def test_logspace_of_one_step_is_base_to_the_unrounded_start():
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        same_on_both(lambda device: torch.logspace(4.3, -3, 1, base=10.0, dtype=dtype, device=device))


def test_factory_calls_on_the_default_device():
    with torch.device("tpu"):
        actual = (torch.arange(2), torch.linspace(1, 3, 1), torch.logspace(3, 1, 1, 2.0))
    expected = (torch.arange(2), torch.linspace(1, 3, 1), torch.logspace(3, 1, 1, 2.0))
    for a, e in zip(actual, expected):
        assert a.device.type == "tpu"
        torch.testing.assert_close(a.cpu(), e)


def test_arange_out_and_float_steps_truncated_for_integer_results():
    same_on_both(lambda device: torch.arange(0, 5, 1.5, dtype=torch.int64, device=device))
    same_on_both(lambda device: torch.arange(-2.5, 4, 1.25, dtype=torch.int32, device=device))
    same_on_both(lambda device: torch.arange(1, 4, out=torch.empty(3, device=device)))


@pytest.mark.parametrize("value", [7, -1.5, True, 2**40])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.int64, torch.bfloat16, torch.bool])
def test_full_and_friends(value, dtype):
    same_on_both(lambda device: torch.full((2, 3), value, dtype=dtype, device=device))
    same_on_both(lambda device: torch.full((), value, dtype=dtype, device=device))
    base = torch.ones(2, 3, 4)
    same_on_both(lambda device: torch.full_like(base.to(device), value, dtype=dtype))
    same_on_both(lambda device: base.to(device).new_full((5,), value, dtype=dtype))
    same_on_both(lambda device: torch.scalar_tensor(value, dtype=dtype or torch.float32, device=device))


def test_fill_value_change_does_not_recompile():
    torch.full((3,), 1.0, device="tpu").cpu()
    before = torchtpu.metrics().get("eager_programs", 0)
    for value in (2.0, 3.0, -4.5):
        assert torch.full((3,), value, device="tpu").cpu().tolist() == [value] * 3
    assert torchtpu.metrics().get("eager_programs", 0) == before


def test_like_ops_keep_memory_format():
    channels_last = torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last)
    for op in (torch.zeros_like, torch.ones_like):
        same_on_both(lambda device: op(channels_last.to(device)))
    same_on_both(lambda device: torch.full_like(channels_last.to(device), 2.5))
    same_on_both(lambda device: torch.full_like(channels_last.to(device), 3, memory_format=torch.contiguous_format))
    transposed = torch.ones(4, 6).t()
    same_on_both(lambda device: torch.full_like(transposed.to(device), 7, dtype=torch.int32))


def test_zeros_ones_new_and_empty_shapes():
    same_on_both(lambda device: torch.zeros(2, 0, 3, device=device))
    same_on_both(lambda device: torch.ones(4, dtype=torch.int8, device=device))
    same_on_both(lambda device: torch.ones(2, 3, device=device).new_zeros((3, 2), dtype=torch.bool))
    same_on_both(lambda device: torch.ones(2, 3, device=device).new_ones(5))
    for empty in (torch.empty(2, 3, device="tpu"), torch.empty_like(torch.ones(3, 2).t().to("tpu")),
                  torch.ones(1, device="tpu").new_empty((4, 1), dtype=torch.int64)):
        assert empty.device.type == "tpu"
    assert torch.empty_like(torch.ones(3, 2).t().to("tpu")).stride() == (1, 2)


@pytest.mark.parametrize("n, m", [(3, None), (1, None), (0, None), (3, 5), (5, 2), (4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_eye(n, m, dtype):
    args = (n,) if m is None else (n, m)
    same_on_both(lambda device: torch.eye(*args, dtype=dtype, device=device))


@pytest.mark.parametrize("steps", [0, 1, 2, 7, 50])
@pytest.mark.parametrize("dtype", [None, torch.float64, torch.bfloat16, torch.int64])
def test_linspace_logspace(steps, dtype):
    same_on_both(lambda device: torch.linspace(-3.3, 12.9, steps, dtype=dtype, device=device))
    same_on_both(lambda device: torch.linspace(5, -5, steps, dtype=dtype, device=device))
    same_on_both(lambda device: torch.logspace(-2, 2.5, steps, dtype=dtype, device=device))
    same_on_both(lambda device: torch.logspace(0, 6, steps, base=2, dtype=dtype, device=device))


def test_logspace_rounds_its_bounds_to_the_output_dtype():
    same_on_both(lambda device: torch.logspace(4.3, -3, 2, dtype=torch.bfloat16, device=device))
    same_on_both(lambda device: torch.logspace(0.1, 2.7, 33, dtype=torch.float16, device=device))


def test_linspace_tensor_bounds_and_out():
    same_on_both(lambda device: torch.linspace(torch.tensor(-1.0), torch.tensor(2.0), 9, device=device))
    same_on_both(lambda device: torch.linspace(0, 1, 5, out=torch.empty(5, device=device)))
    same_on_both(lambda device: torch.logspace(0, 1, 4, out=torch.empty(4, dtype=torch.float64, device=device)))


@pytest.mark.parametrize("row, col, offset", [(4, 5, 0), (4, 5, 1), (5, 3, -1), (3, 3, -5), (3, 3, 7), (0, 4, 0), (6, 1, 2)])
def test_triangle_indices(row, col, offset):
    same_on_both(lambda device: torch.tril_indices(row, col, offset, device=device))
    same_on_both(lambda device: torch.triu_indices(row, col, offset, device=device))
    same_on_both(lambda device: torch.tril_indices(row, col, offset, dtype=torch.int32, device=device))


WINDOWS = {
    "hamming": lambda n, periodic, **kw: torch.hamming_window(n, periodic, **kw),
    "hamming_alpha_beta": lambda n, periodic, **kw: torch.hamming_window(n, periodic, alpha=0.5, beta=0.3, **kw),
    "blackman": lambda n, periodic, **kw: torch.blackman_window(n, periodic, **kw),
    "bartlett": lambda n, periodic, **kw: torch.bartlett_window(n, periodic, **kw),
    "kaiser": lambda n, periodic, **kw: torch.kaiser_window(n, periodic, **kw),
    "kaiser_beta": lambda n, periodic, **kw: torch.kaiser_window(n, periodic, 5.0, **kw),
}


@pytest.mark.parametrize("name", sorted(WINDOWS))
@pytest.mark.parametrize("periodic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_window_functions(name, periodic, dtype):
    """ATen's steps in the output dtype: equal to CPU but for the last bits of `cos` and `i0`
    (within 4 eps of the window's [0, 1] values). `kaiser_window` failed on tpu before (its
    kernel is a CPU/CUDA dispatch stub)."""
    window = WINDOWS[name]
    for n in (0, 1, 2, 7, 64):
        expected = window(n, periodic, dtype=dtype)
        actual = window(n, periodic, dtype=dtype, device="tpu")
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=4 * torch.finfo(dtype).eps)


def test_window_functions_run_inside_a_compiled_graph():
    """They split compiled graphs before (their composite kernels stay nodes in AOTAutograd's)."""
    import warnings

    def tapered(x):
        d = x.device
        return (x * torch.hamming_window(8, device=d) + torch.kaiser_window(8, device=d)
                + torch.blackman_window(8, device=d) * torch.bartlett_window(8, device=d))

    torchtpu.reset_metrics()
    x = torch.randn(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        actual = torch.compile(tapered, backend="tpu")(x.to("tpu"))
    torch.testing.assert_close(actual.cpu(), tapered(x))
    assert "compiled_graphs_split" not in torchtpu.metrics()


@pytest.mark.parametrize("args, dtype", [((0, 4, 0.5), None), ((1, 4), torch.int64), ((3, -1, -0.75), torch.float64)])
def test_range_includes_its_end(args, dtype):
    """The deprecated `torch.range` (old code still calls it): `arange`'s values, `end` included."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch's deprecation warning
        same_on_both(lambda device: torch.range(*args, dtype=dtype, device=device))
