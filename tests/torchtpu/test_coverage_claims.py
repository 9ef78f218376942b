"""The op-coverage claims that need no sweep: the Core ATen opset runs natively on `tpu`.

Every overload tagged `torch.Tag.core` must be lowered (or be a metadata-only view, a backend
memory kernel, a composite that reaches only native ops, or run as a decomposition); none may
need the CPU fallback. The failure message lists every missing overload; there are no exceptions.
(OpInfo pass counts come from the sweep: tests/opinfo, docs/op-coverage.md.)
"""

import torch

from opinfo import coverage  # tests/ is on sys.path (rootdir conftest); tests/opinfo/coverage.py


def test_core_aten_opset_is_native():
    core = coverage.core_aten_ops()
    assert len(core) > 150, f"only {len(core)} overloads tagged core: the opset lookup is broken"
    missing = [str(op) for op in core if coverage.native_kind(op) is None]
    assert not missing, (
        f"{len(missing)} of {len(core)} Core ATen overloads have no native tpu implementation "
        f"(they would need the CPU fallback): {', '.join(missing)}"
    )


def test_native_kind_is_none_for_an_op_without_lowering():
    """The classifier can say no: an op nobody lowers on tpu (a CPU-only quantized kernel)."""
    assert coverage.native_kind(torch.ops.aten.quantize_per_tensor.default) is None
