"""The op-coverage claims that need no sweep: the Core ATen opset runs natively on `tpu`.

Every overload tagged `torch.Tag.core` must be lowered (or be a metadata-only view, a backend
memory kernel, a composite that reaches only native ops, or run as a decomposition); none may
need the CPU fallback. The failure message lists every missing overload. The only exceptions are
the overloads that need complex dtypes, which tpu tensors do not support; they are listed, and the
list must stay true. (OpInfo pass counts come from the sweep: tests/opinfo, docs/op-coverage.md.)
"""

import torch

from opinfo import coverage  # tests/ is on sys.path (rootdir conftest); tests/opinfo/coverage.py

# Core ATen overloads that take or return complex tensors (the real-to-complex and
# complex-to-real FFTs): not native until tpu tensors have complex dtypes (torchtpu.dtypes).
NEEDS_COMPLEX = {"aten._fft_r2c.default", "aten._fft_c2r.default"}


def test_core_aten_opset_is_native():
    core = coverage.core_aten_ops()
    assert len(core) > 150, f"only {len(core)} overloads tagged core: the opset lookup is broken"
    missing = [str(op) for op in core if coverage.native_kind(op) is None and str(op) not in NEEDS_COMPLEX]
    assert not missing, (
        f"{len(missing)} of {len(core)} Core ATen overloads have no native tpu implementation "
        f"(they would need the CPU fallback): {', '.join(missing)}"
    )


def test_the_exceptions_are_core_ops_that_still_need_complex_dtypes():
    core = {str(op): op for op in coverage.core_aten_ops()}
    for name in NEEDS_COMPLEX:
        op = core[name]
        assert coverage.native_kind(op) is None, f"{name} runs natively now: remove it from NEEDS_COMPLEX"


def test_native_kind_is_none_for_an_op_without_lowering():
    """The classifier can say no: an op nobody lowers on tpu (a CPU-only quantized kernel)."""
    assert coverage.native_kind(torch.ops.aten.quantize_per_tensor.default) is None
