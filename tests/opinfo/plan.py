"""Which OpInfo cases a test run covers, and how many samples of each.

The full sweep -- every entry, check, eager mode and sample -- takes many hours on the 2-core CI
machine (each new op and shape compiles an XLA program), so by default the suite runs a
deterministic subset sized for CI (a few minutes):

- each (check, mode) runs one entry in `STRIDES[(check, mode)]`, chosen by a stable hash of the
  entry and check names: a fixed mix of op families that does not change from run to run;
- the data-dependent-shape entries (`PINNED`) run float32 forward in every eager mode, up to
  their data-dependent samples;
- a selected case that is an expected failure runs all its samples, so a strict xfail cannot pass
  merely because its failing sample was left out.

Environment:
- `TORCHTPU_OPINFO_FULL=1`: the full sweep (all cases, all samples, no time budget);
- `TORCHTPU_OPINFO_SAMPLES=N`: samples per selected case (default `CI_SAMPLES`; "all");
- `TORCHTPU_OPINFO_SHARD=i/n`: only cases whose id hashes to shard i of n (split a run over jobs).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import zlib
from dataclasses import dataclass

import pytest
from torch.testing._internal.opinfo.core import OpInfo

from . import expectations
from .harness import (ALL_SAMPLES, CHECKS, EAGER_MODES, CaseFailure, Check, Selection, entries,
                      mode_unavailable, run_case)

CI_SAMPLES = 1
CI_BUDGET_S = 5.0
# (check, mode) -> run one entry in N in CI; absent pairs run only PINNED entries. debug reuses
# the programs strict compiled (same cache keys), so it costs little more than strict.
STRIDES = {
    ("float32", "strict"): 10, ("float32", "debug"): 10, ("float32", "defer"): 40,
    ("bfloat16", "strict"): 40, ("int64", "strict"): 40, ("grad", "strict"): 40,
    ("inplace", "strict"): 20,
}
# Ops whose output shape depends on values: float32 forward in every eager mode, CI included,
# with as many samples as it takes to reach the data-dependent ones (boolean-mask indexing is
# sample 14 of `__getitem__`, samples 1 and 3 of `index_put`).
PINNED = {"nonzero": 2, "argwhere": 2, "unique": 2, "unique_consecutive": 2, "masked_select": 2,
          "__getitem__": 15, "index_put": 4, "repeat_interleave": 2, "bincount": 2}


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


def full_sweep() -> bool:
    return os.environ.get("TORCHTPU_OPINFO_FULL", "0") not in ("", "0")


def _shard() -> tuple[int, int]:
    text = os.environ.get("TORCHTPU_OPINFO_SHARD", "0/1")
    index, _, count = text.partition("/")
    try:
        index, count = int(index), int(count)
    except ValueError:
        raise ValueError(f"TORCHTPU_OPINFO_SHARD={text!r}: expected i/n, e.g. 0/4") from None
    if not 0 <= index < count:
        raise ValueError(f"TORCHTPU_OPINFO_SHARD={text!r}: need 0 <= i < n")
    return index, count


def _ci_selection() -> Selection:
    text = os.environ.get("TORCHTPU_OPINFO_SAMPLES", str(CI_SAMPLES))
    if text == "all":
        return Selection(None, CI_BUDGET_S)
    return Selection(int(text), CI_BUDGET_S)


@dataclass(frozen=True)
class Case:
    entry: str
    check: Check
    mode: str
    selection: Selection

    @property
    def id(self) -> str:
        return f"{self.check.name}-{self.mode}-{self.entry}"

    @property
    def opinfo(self) -> OpInfo:
        return entries()[self.entry]


def _ci_case(entry: str, check: Check, mode: str, selection: Selection) -> Selection | None:
    """The samples of this case the CI subset runs, or None if it does not run the case."""
    if entry in PINNED and check.name == "float32":
        return Selection(max(PINNED[entry], selection.limit or 0), None)
    stride = STRIDES.get((check.name, mode))
    if stride is not None and _stable_hash(f"{check.name}/{entry}") % stride == 0:
        return selection
    return None


def cases(check: Check) -> list[Case]:
    """The cases of `check` this run covers, in every eager mode."""
    full = full_sweep()
    shard, shards = _shard()
    ci = _ci_selection()
    out = []
    for mode in EAGER_MODES:
        for name, opinfo in entries().items():
            if not check.applies_to(opinfo):
                continue
            selection = ALL_SAMPLES if full else _ci_case(name, check, mode, ci)
            if selection is None:
                continue
            case = Case(name, check, mode, selection)
            if _stable_hash(case.id) % shards == shard:
                out.append(case)
    return out


EXPECTED = expectations.load(CHECKS, EAGER_MODES)


def params(*checks: Check) -> list:
    """pytest params for the cases of `checks`; expected failures marked strict xfail."""
    out = []
    for check in checks:
        for case in cases(check):
            reason = EXPECTED.reason(case.entry, check.name, case.mode)
            marks = []
            if reason:
                case = dataclasses.replace(case, selection=ALL_SAMPLES)
                marks = [pytest.mark.xfail(reason=reason, strict=True)]
            out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def check_case(case: Case) -> None:
    """Run one case under pytest: skip a mode that does not exist yet or a case with nothing to
    compare, raise on a mismatch."""
    unavailable = mode_unavailable(case.mode)
    if unavailable:
        pytest.skip(unavailable)
    try:
        result = run_case(case.opinfo, case.check, case.mode, case.selection)
    except CaseFailure as error:
        failure, result = error, None
    if result is None:
        # Plain text: pytest's own traceback would repr every frame's tpu tensors, which
        # compiles programs just to print them.
        cause = failure.__cause__
        trace = "".join(traceback.format_exception(cause)) if cause is not None else ""
        pytest.fail(f"{failure}\n\n{trace}", pytrace=False)
    if result.checked == 0:
        pytest.skip(f"no sample to compare: {result.skipped}")
