"""One OpInfo case -- an entry of PyTorch's `op_db`, a check, an eager mode -- run on `tpu` and CPU.

The reference is PyTorch's CPU kernels. Each sample input of the entry runs on CPU and, copied to
`tpu`, on the device, under `highest` matmul precision and `TORCHTPU_STRICT_OPS=1` (an op that
would fall back to the CPU raises instead, so a pass means native coverage). Outputs are compared
with exact dtypes and shapes and dtype-appropriate tolerances; the OpInfo's own tolerance overrides
raise them where PyTorch declares that an op's numerics vary between correct implementations.

A check is what is compared: the forward in float32, bfloat16 or int64, the gradients (a VJP with
a fixed random cotangent, `torch.autograd.grad`), or the in-place variant's forward.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torchtpu
from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import DecorateInfo, OpInfo, SampleInput
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torchtpu.exec import modes
from torchtpu.exec.kernels import StrictOpsError

DEVICE_TYPE = "tpu"
# The device every case runs on; a sweep worker takes its own (`use_device`), as a process owns a
# TPU chip.
DEVICE = torch.device(DEVICE_TYPE, 0)
# Every eager mode torchtpu defines; one that raises NotImplementedError is skipped until it exists.
EAGER_MODES: tuple[str, ...] = modes.MODES


@dataclass(frozen=True)
class Check:
    """What a case compares: `kind` is "forward", "grad" or "inplace", for samples of `dtype`."""

    name: str
    kind: str
    dtype: torch.dtype

    def applies_to(self, opinfo: OpInfo) -> bool:
        if self.dtype not in opinfo.supported_dtypes("cpu"):
            return False
        if self.kind == "grad":
            return opinfo.supports_autograd and self.dtype in opinfo.supported_backward_dtypes("cpu")
        if self.kind == "inplace":
            return opinfo.inplace_variant is not None
        return True


FLOAT32 = Check("float32", "forward", torch.float32)
BFLOAT16 = Check("bfloat16", "forward", torch.bfloat16)
INT64 = Check("int64", "forward", torch.int64)
GRAD = Check("grad", "grad", torch.float32)
INPLACE = Check("inplace", "inplace", torch.float32)
CHECKS: dict[str, Check] = {c.name: c for c in (FLOAT32, BFLOAT16, INT64, GRAD, INPLACE)}

# Base tolerances by the dtype of the compared value (a complex value by its components' dtype);
# integer and bool values compare exactly.
# float32: XLA's transcendental approximations and reduction orders differ from ATen's by a few
# ulps, which composite ops accumulate. bfloat16: 4 ulps (PyTorch's own bf16 rtol), with an
# absolute floor for results that cancel to near zero. float16 and float64: PyTorch's defaults.
BASE_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
}
# PyTorch test classes whose tolerance overrides say "this op's numerics legitimately vary between
# implementations" (reference, decomposition and gradient comparisons), device-agnostic ones only.
_NUMERICS_TEST_CLASSES = frozenset(
    {"TestCommon", "TestUnaryUfuncs", "TestBinaryUfuncs", "TestReductions", "TestDecomp",
     "TestFFT", "TestMasked", "TestGradients", "TestOperators"}
)
# PyTorch's own device-vs-CPU comparison; its skips with a reason say values are undefined.
_COMPARE_CPU_TEST = ("TestCommon", "test_compare_cpu")


def entry_name(opinfo: OpInfo) -> str:
    return opinfo.name + ("." + opinfo.variant_test_name if opinfo.variant_test_name else "")


@lru_cache(maxsize=None)
def entries() -> dict[str, OpInfo]:
    """Every OpInfo of `op_db` by entry name (name plus variant)."""
    return {entry_name(o): o for o in op_db}


def tolerance_override(opinfo: OpInfo, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) that the OpInfo's own overrides for `dtype` samples allow ((0, 0) if none)."""
    rtol = atol = 0.0
    for decoration in opinfo.decorators:
        if isinstance(decoration, DecorateInfo):
            if decoration.cls_name not in _NUMERICS_TEST_CLASSES or not decoration.is_active(
                decoration.cls_name, decoration.test_name, DEVICE_TYPE, dtype, {}
            ):
                continue
            decorators = decoration.decorators
        else:
            decorators = [decoration]
        for decorator in decorators:
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                rtol = max(rtol, decorator.d[dtype].rtol)
                atol = max(atol, decorator.d[dtype].atol)
            elif isinstance(decorator, precisionOverride) and dtype in decorator.d:
                atol = max(atol, decorator.d[dtype])
    return rtol, atol


def tolerance(value_dtype: torch.dtype, override: tuple[float, float]) -> tuple[float, float]:
    """(rtol, atol) for comparing values of `value_dtype`: its base (a complex dtype's is its
    components') raised by `override`; integers and bools exactly."""
    if value_dtype.is_complex:
        value_dtype = value_dtype.to_real()
    if not value_dtype.is_floating_point:
        return 0.0, 0.0
    rtol, atol = BASE_TOLERANCE[value_dtype]
    return max(rtol, override[0]), max(atol, override[1])


def _skip_reason(decorator: Callable) -> str | None:
    """The reason string of a `unittest.skip(reason)` decorator, else None."""
    for cell in getattr(decorator, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, str) and value != "Skipped!":
            return value
    return None


def _draws_random_numbers(opinfo: OpInfo) -> bool:
    """OpInfo wraps random ops in `wrapper_set_seed` so CPU runs repeat; a device's generator
    differs from CPU's, so their values cannot match."""
    return "wrapper_set_seed" in getattr(getattr(opinfo.op, "__code__", None), "co_names", ())


def values_undefined(opinfo: OpInfo, dtype: torch.dtype) -> str | None:
    """Why the entry's output values are not determined by its inputs, if PyTorch says so: random
    ops, uninitialized memory, or a skip of its own device-vs-CPU comparison with a reason
    (undefined order, overflowing casts). Such entries are compared by structure, dtypes and
    shapes only, and their gradients not at all."""
    if opinfo.has_nondeterministic_output:
        return "output is non-deterministic (OpInfo.has_nondeterministic_output)"
    if _draws_random_numbers(opinfo):
        return "draws random numbers (OpInfo runs it under wrapper_set_seed)"
    for decoration in (*opinfo.decorators, *opinfo.skips):
        if not isinstance(decoration, DecorateInfo) or not decoration.is_active(
            *_COMPARE_CPU_TEST, DEVICE_TYPE, dtype, {}
        ):
            continue
        for decorator in decoration.decorators:
            reason = _skip_reason(decorator)
            if reason is not None:
                return f"{reason} (OpInfo skip of {'.'.join(_COMPARE_CPU_TEST)})"
    return None


def use_device(index: int) -> None:
    """Run every case on `tpu:<index>` (and make it the current device)."""
    global DEVICE
    torch.tpu.set_device(index)
    DEVICE = torch.device(DEVICE_TYPE, index)


# --- eager modes ---------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def mode_unavailable(mode: str) -> str | None:
    """None if `mode` runs a tiny program; the reason if it raises NotImplementedError."""
    try:
        with torchtpu.eager_mode(mode):
            (torch.ones(2, device=DEVICE) + 1).cpu()
    except NotImplementedError as error:
        return f"eager mode {mode!r} is not implemented: {error}"
    return None


# --- samples -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which samples of an entry run: the first `limit` (None: all), and no new sample once
    `budget_s` seconds have passed (None: no budget); at least one sample always runs."""

    limit: int | None = None
    budget_s: float | None = None

    def pick(self, samples: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        start = time.perf_counter()
        for index, sample in enumerate(samples):
            if self.limit is not None and index >= self.limit:
                return
            if index and self.budget_s is not None and time.perf_counter() - start > self.budget_s:
                return
            yield index, sample


ALL_SAMPLES = Selection()


def _leaves(sample: SampleInput) -> tuple[list[Any], Any]:
    return tree_flatten((sample.input, sample.args, sample.kwargs))


def _tensors(sample: SampleInput) -> list[torch.Tensor]:
    return [leaf for leaf in _leaves(sample)[0] if isinstance(leaf, torch.Tensor)]


class Placement(NamedTuple):
    """Of a sample's `n_leaves` leaves (input, args, kwargs flattened), those the OpInfo creates
    on CPU whatever device it generates samples for."""

    n_leaves: int
    cpu_only: frozenset[int]


def cpu_placements(opinfo: OpInfo, dtype: torch.dtype, requires_grad: bool) -> Iterator[Placement | None]:
    """Per sample, in order, its `Placement` (`tensor_split`'s index tensor must be on CPU, on
    CUDA as here), found by generating the samples for the meta device; None where that fails."""
    try:
        for sample in opinfo.sample_inputs("meta", dtype, requires_grad=requires_grad):
            leaves = _leaves(sample)[0]
            yield Placement(len(leaves), frozenset(
                i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"
            ))
    except Exception:  # noqa: BLE001 -- a sample function that cannot run on meta: move all
        pass
    yield from itertools.repeat(None)


def _tensor_to_device(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` on `tpu` with its sizes, strides and storage offset: a view is copied with
    its whole storage (`as_strided` with an explicit offset addresses the storage, not the view)."""
    t = t.detach()
    storage_numel = t.untyped_storage().nbytes() // t.element_size()
    if t.layout != torch.strided or (t.is_contiguous() and t.storage_offset() == 0 and t.numel() == storage_numel):
        return t.to(DEVICE)
    storage = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (storage_numel,), (1,))
    return storage.to(DEVICE).as_strided(t.shape, t.stride(), t.storage_offset()).detach()


def _to_device(value: Any) -> Any:
    """A sample argument as the `tpu` run takes it: tensors copied with their layout (keeping
    requires_grad), and CPU devices -- factory functions' `device=`, `Tensor.to("cpu")` --
    replaced by `tpu`."""
    if isinstance(value, torch.Tensor):
        return _tensor_to_device(value).requires_grad_(value.requires_grad)
    if isinstance(value, torch.device) and value.type == "cpu":
        return DEVICE
    if isinstance(value, str) and value in ("cpu", "cpu:0"):
        return str(DEVICE)
    return value


def to_device(sample: SampleInput, placement: Placement | None = None) -> SampleInput:
    """The sample for the `tpu` run: every leaf moved (`_to_device`), except the CPU-only ones of
    `placement`, which stay CPU copies."""
    leaves, spec = _leaves(sample)
    keep = placement.cpu_only if placement is not None and placement.n_leaves == len(leaves) else ()
    moved = [leaf.detach().clone().requires_grad_(leaf.requires_grad) if i in keep else _to_device(leaf)
             for i, leaf in enumerate(leaves)]
    input, args, kwargs = tree_unflatten(moved, spec)
    return SampleInput(input, args=args, kwargs=kwargs, output_process_fn_grad=sample.output_process_fn_grad,
                       broadcasts_input=sample.broadcasts_input, name=sample.name)


def unsupported_sample(sample: SampleInput) -> str | None:
    """Why a sample cannot be placed on `tpu` at all (not an op failure), else None."""
    if any(t.layout != torch.strided for t in _tensors(sample)):
        return "sparse layout input (tpu tensors are strided)"
    return None


def describe(index: int, sample: SampleInput) -> str:
    """A short description of a sample for failure messages."""

    def meta(value):
        if isinstance(value, torch.Tensor):
            return f"Tensor{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
        return value

    input, args, kwargs = tree_map(meta, (sample.input, sample.args, sample.kwargs))
    text = f"sample {index} {sample.name!r}: input={input} args={args} kwargs={kwargs}"
    return text if len(text) <= 400 else text[:400] + "..."


# --- comparison ----------------------------------------------------------------------------------


class CaseFailure(AssertionError):
    """A sample's `tpu` run disagrees with CPU: `where` names the case and sample, `detail` how."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.where = where
        self.detail = detail


class Mismatch(CaseFailure):
    """The `tpu` result differs from CPU's."""


class DeviceFailure(CaseFailure):
    """The `tpu` run raised where CPU did not (or raised another kind of exception)."""

    def __init__(self, where: str, error: BaseException) -> None:
        first_line = (str(error).strip().splitlines() or [""])[0]
        super().__init__(where, f"{type(error).__name__}: {first_line}")
        self.error = error


def compare(actual: Any, expected: Any, override: tuple[float, float], where: str, values: bool = True) -> None:
    """`actual` (from tpu) equals `expected` (from CPU): same structure, dtypes and shapes, values
    within `tolerance` of their dtype and `override` unless `values` is False; every tensor of
    `actual` lives on `tpu`."""
    actual_leaves, actual_spec = tree_flatten(actual)
    expected_leaves, expected_spec = tree_flatten(expected)
    if actual_spec != expected_spec:
        raise Mismatch(where, f"output structure {actual_spec} != CPU's {expected_spec}")
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        label = f"{where}, output {i}"
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(label, f"got {type(a).__name__}, CPU returned a tensor")
            if a.device != DEVICE:
                raise Mismatch(label, f"tensor on {a.device}, expected it on {DEVICE}")
            if not values:
                if (a.dtype, a.shape) != (e.dtype, e.shape):
                    raise Mismatch(label, f"{a.dtype}{list(a.shape)} != CPU's {e.dtype}{list(e.shape)}")
                continue
            a = a.cpu()
        elif not values:
            continue
        elif isinstance(e, float) and isinstance(a, float):  # e.g. item() of a float32 result
            a, e = torch.tensor(a, dtype=torch.float32), torch.tensor(e, dtype=torch.float32)
        elif type(a) is not type(e) or a != e:
            raise Mismatch(label, f"got {a!r}, CPU returned {e!r}")
        else:
            continue
        rtol, atol = tolerance(e.dtype, override)
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as error:
            raise Mismatch(label, " ".join(str(error).split())) from None


def _run(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 -- compared with the other device's outcome
        return None, error


def _same_failure(actual: BaseException | None, expected: BaseException, where: str) -> None:
    """CPU rejected the sample: tpu must reject it with the same kind of exception."""
    if actual is None:
        raise Mismatch(where, f"CPU raised {type(expected).__name__}: {expected}; tpu did not raise")
    if isinstance(actual, StrictOpsError) or not isinstance(actual, type(expected)):
        raise DeviceFailure(where, actual) from actual


def _cotangent(like: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=generator, dtype=like.dtype)


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(outputs)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


# --- cases ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """How one sample's results are compared: the OpInfo's tolerance override, and whether values
    are compared (see `values_undefined`); `where` names the case and sample in messages."""

    override: tuple[float, float]
    values: bool
    where: str

    def __call__(self, actual: Any, expected: Any, what: str = "") -> None:
        compare(actual, expected, self.override, f"{self.where}{what}", self.values)


@dataclass
class CaseResult:
    """What a case ran: samples compared, samples skipped by reason, whether values were compared
    (or only structure, dtypes and shapes), and the decompositions it ran."""

    checked: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    values_compared: bool = True
    decomposed_ops: set[str] = field(default_factory=set)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


@contextlib.contextmanager
def strict_ops() -> Iterator[None]:
    """`TORCHTPU_STRICT_OPS=1` while a case runs (and only then: later tests in the same process
    may exercise the CPU fallback)."""
    previous = os.environ.get("TORCHTPU_STRICT_OPS")
    os.environ["TORCHTPU_STRICT_OPS"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCHTPU_STRICT_OPS"]
        else:
            os.environ["TORCHTPU_STRICT_OPS"] = previous


def run_case(opinfo: OpInfo, check: Check, mode: str, selection: Selection = ALL_SAMPLES) -> CaseResult:
    """Run the selected samples of `opinfo` for `check` in eager `mode`; raise on the first
    sample whose tpu result differs from CPU's (or that fails on tpu only)."""
    name = entry_name(opinfo)
    override = tolerance_override(opinfo, check.dtype)
    undefined = values_undefined(opinfo, check.dtype)
    result = CaseResult(values_compared=undefined is None)
    if undefined is not None and check.kind == "grad":
        result.skip(f"gradients not compared: {undefined}")
        return result
    requires_grad = check.kind == "grad"
    torch.manual_seed(zlib.crc32(name.encode()))  # the same samples whatever ran before
    samples = zip(opinfo.sample_inputs("cpu", check.dtype, requires_grad=requires_grad),
                  cpu_placements(opinfo, check.dtype, requires_grad))
    runner = {"forward": _forward, "grad": _grad, "inplace": _inplace}[check.kind]
    for index, (sample, placement) in selection.pick(samples):
        reason = unsupported_sample(sample)
        if reason is not None:
            result.skip(reason)
            continue
        comparison = Comparison(override, undefined is None, f"{name} [{check.name}, {mode}] {describe(index, sample)}")
        before = torchtpu.metrics().get("decomposed_ops", {})
        with torchtpu.eager_mode(mode), torch.tpu.precision("highest"), strict_ops():
            reason = runner(opinfo, sample, to_device(sample, placement), comparison,
                            zlib.crc32(f"{name}/{index}".encode()))
        if reason is not None:
            result.skip(reason)
            continue
        result.checked += 1
        after = torchtpu.metrics().get("decomposed_ops", {})
        result.decomposed_ops.update(op for op, n in after.items() if n > before.get(op, 0))
    return result


def _default_device(sample: SampleInput) -> contextlib.AbstractContextManager:
    """`tpu` as the default device for a sample that names no device and has no tensor (a factory
    call such as `torch.arange(3)`, which creates its result on the default device), else no-op."""
    leaves = _leaves(sample)[0]
    if any(isinstance(leaf, (torch.Tensor, torch.device)) for leaf in leaves) or "device" in sample.kwargs:
        return contextlib.nullcontext()
    return torch.device(DEVICE)


def _forward(opinfo: OpInfo, sample: SampleInput, device_sample: SampleInput, assert_same: Comparison,
             seed: int) -> str | None:
    expected, cpu_error = _run(lambda: opinfo(sample.input, *sample.args, **sample.kwargs))
    with _default_device(device_sample):
        actual, error = _run(lambda: opinfo(device_sample.input, *device_sample.args, **device_sample.kwargs))
    if cpu_error is not None:
        _same_failure(error, cpu_error, assert_same.where)
        return None
    if error is not None:
        raise DeviceFailure(assert_same.where, error) from error
    assert_same(sample.output_process_fn_grad(actual), sample.output_process_fn_grad(expected))
    return None


def _vjp(opinfo: OpInfo, sample: SampleInput, seed: int, device: str | None):
    """(differentiable outputs, gradients of sum(outputs * cotangents) w.r.t. the inputs)."""
    outputs = sample.output_process_fn_grad(
        opinfo.gradcheck_wrapper(opinfo.get_op(), sample.input, *sample.args, **sample.kwargs)
    )
    outputs = _differentiable(outputs)
    inputs = [t for t in _tensors(sample) if t.requires_grad]
    if not outputs or not inputs:
        return outputs, None
    cotangents = [_cotangent(o, seed + i) for i, o in enumerate(outputs)]
    if device is not None:
        cotangents = [c.to(device) for c in cotangents]
    grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    return outputs, grads


def _grad(opinfo: OpInfo, sample: SampleInput, device_sample: SampleInput, assert_same: Comparison,
          seed: int) -> str | None:
    expected, cpu_error = _run(lambda: _vjp(opinfo, sample, seed, None))
    if cpu_error is not None:
        return f"CPU cannot differentiate the sample ({type(cpu_error).__name__})"
    if expected[1] is None:
        return "no differentiable output or input"
    actual, error = _run(lambda: _vjp(opinfo, device_sample, seed, DEVICE))
    if error is not None:
        raise DeviceFailure(assert_same.where, error) from error
    assert_same(actual[0], expected[0], " (forward)")
    assert_same(actual[1], expected[1], " (gradients)")
    return None


def _inplace(opinfo: OpInfo, sample: SampleInput, device_sample: SampleInput, assert_same: Comparison,
             seed: int) -> str | None:
    if not isinstance(sample.input, torch.Tensor):
        return "the input is not a tensor"
    if sample.broadcasts_input:
        return "the input broadcasts (an in-place op cannot write into it)"
    variant = opinfo.inplace_variant
    cpu_self, device_self = sample.input.clone(), device_sample.input.clone()
    expected, cpu_error = _run(lambda: variant(cpu_self, *sample.args, **sample.kwargs))
    actual, error = _run(lambda: variant(device_self, *device_sample.args, **device_sample.kwargs))
    if cpu_error is not None:
        _same_failure(error, cpu_error, assert_same.where)
        return None
    if error is not None:
        raise DeviceFailure(assert_same.where, error) from error
    if (expected is cpu_self) != (actual is device_self):
        returned = "self" if expected is cpu_self else "a new tensor"
        raise Mismatch(assert_same.where, f"the in-place variant returned {returned} on CPU but not on tpu")
    assert_same(device_self, cpu_self, " (self after the in-place op)")
    return None
