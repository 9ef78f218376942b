"""The expected-failures file and the tooling that rewrites it."""

import pytest

from . import expectations, update
from .harness import CHECKS, EAGER_MODES, entries

MODES = ("strict", "debug", "defer")


def test_every_expected_failure_names_a_real_case():
    """A typo in an entry or check name would silently expect nothing."""
    expected = expectations.load(CHECKS, EAGER_MODES)
    for check, mode, entry in expected.reasons:
        assert entry in entries(), f"expected_failures.toml: [{check}] {entry!r} is not an op_db entry"
        assert CHECKS[check].applies_to(entries()[entry]), (
            f"expected_failures.toml: [{check}] {entry!r}: the check does not apply to this entry"
        )


def test_render_then_parse_round_trips():
    reasons = {("float32", None, "linalg.eigh"): 'needs "eigh"', ("grad", "defer", "cumsum"): "a \\ b"}
    text = expectations.render(reasons, CHECKS, MODES)
    assert expectations.parse(text, CHECKS, MODES).reasons == reasons


def test_parse_rejects_unknown_tables_and_empty_reasons():
    with pytest.raises(ValueError, match="unknown table"):
        expectations.parse("[float16]\nadd = 'x'\n", CHECKS, MODES)
    with pytest.raises(ValueError, match="non-empty reason"):
        expectations.parse("[float32]\nadd = ''\n", CHECKS, MODES)


def test_mode_specific_reason_wins_over_shared():
    parsed = expectations.parse("[float32]\nadd = 'all'\n[defer.float32]\nadd = 'defer'\n", CHECKS, MODES)
    assert parsed.reason("add", "float32", "strict") == "all"
    assert parsed.reason("add", "float32", "defer") == "defer"


def _record(entry, check, mode, status, detail="boom"):
    record = {"entry": entry, "check": check, "mode": mode, "status": status, "detail": detail}
    return record | ({"error": "StrictOpsError"} if status == "fail" else {})


def test_expected_from_a_sweep():
    previous = {("float32", None, "sin"): "kept reason", ("float32", None, "cos"): "now passes"}
    records = [
        *(_record("sin", "float32", m, "fail") for m in MODES),
        *(_record("cos", "float32", m, "pass") for m in MODES),
        _record("tan", "float32", "strict", "pass"), _record("tan", "float32", "debug", "pass"),
        _record("tan", "float32", "defer", "timeout", "no result within 900s"),
    ]
    reasons = update.expected_from(records, previous, MODES)
    assert reasons == {
        ("float32", None, "sin"): "kept reason",
        ("float32", "defer", "tan"): "timeout: no result within 900s",
    }


def test_expected_from_a_partial_sweep_keeps_other_modes():
    previous = {("grad", None, "sin"): "reason"}
    reasons = update.expected_from([_record("sin", "grad", "strict", "pass")], previous, MODES)
    assert reasons == {("grad", "debug", "sin"): "reason", ("grad", "defer", "sin"): "reason"}


def test_expected_from_ignores_unavailable_modes():
    records = [_record("sin", "int64", "strict", "fail"), _record("sin", "int64", "debug", "fail"),
               _record("sin", "int64", "defer", "skip", "eager mode 'defer' is not implemented")]
    reasons = update.expected_from(records, {}, MODES)
    assert reasons == {("int64", None, "sin"): "StrictOpsError: boom"}
