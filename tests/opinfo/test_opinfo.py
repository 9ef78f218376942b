"""Every OpInfo of PyTorch's `op_db`, run on `tpu` and compared with CPU.

The reference is PyTorch itself: each OpInfo's sample inputs run on CPU and, moved to `tpu`, on
the device, under `highest` matmul precision and `TORCHTPU_STRICT_OPS=1` (a CPU fallback is not
coverage). Expected failures live in `expected_failures.toml` with a reason each; an entry there
that passes fails the suite, so the list stays true.

Select ops with `-k`, e.g. `pytest tests/opinfo -k "add or mul"`. `TORCHTPU_OPINFO_SAMPLES`
caps the samples per entry (default 4).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
import torch

os.environ["TORCHTPU_STRICT_OPS"] = "1"

import torchtpu  # noqa: E402,F401
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

MAX_SAMPLES = int(os.environ.get("TORCHTPU_OPINFO_SAMPLES", "4"))
_EXPECTED = tomllib.loads((Path(__file__).parent / "expected_failures.toml").read_text())

TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.int64: dict(rtol=0, atol=0),
}


def entry_name(opinfo) -> str:
    return opinfo.name + ("." + opinfo.variant_test_name if opinfo.variant_test_name else "")


def _to(device: str):
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to(device).requires_grad_(x.requires_grad)
        return x

    return move


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _cases(dtype: torch.dtype):
    for opinfo in op_db:
        if dtype not in opinfo.supported_dtypes("cpu"):
            continue
        name = entry_name(opinfo)
        reason = _EXPECTED.get(str(dtype).removeprefix("torch."), {}).get(name)
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        yield pytest.param(opinfo, id=name, marks=marks)


def _check_forward(opinfo, dtype: torch.dtype) -> None:
    samples = list(opinfo.sample_inputs("cpu", dtype, requires_grad=False))[:MAX_SAMPLES]
    for sample in samples:
        expected = opinfo(sample.input, *sample.args, **sample.kwargs)
        moved = sample.transform(_to("tpu"))
        with torch.tpu.precision("highest"):
            actual = opinfo(moved.input, *moved.args, **moved.kwargs)
        actual = tree_map(_cpu, actual)
        torch.testing.assert_close(
            actual, expected, equal_nan=True, **TOLERANCES[dtype], msg=lambda m: f"{sample}: {m}"
        )


@pytest.mark.parametrize("opinfo", list(_cases(torch.float32)))
def test_forward_float32(opinfo):
    _check_forward(opinfo, torch.float32)
