"""Write docs/op-coverage.md: what torchtpu runs natively, from the OpInfo sweep and the registry.

    python docs/gen_op_coverage.py            # from tests/opinfo/sweep_results.json
    python docs/gen_op_coverage.py --sweep    # run the full sweep first (hours; see tests/opinfo/README.md)

Counts come from the sweep's results file (written by `python -m tests.opinfo.update`), op
counts and the Core ATen opset coverage from the live lowering registry.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.opinfo import coverage, expectations, harness, update  # noqa: E402

OUT = ROOT / "docs" / "op-coverage.md"
MODE = harness.EAGER_MODES[0]  # counts are for the default mode; other modes are compared to it
_MISSING_OP = re.compile(r"(aten\.[\w.]+) has no tpu lowering")


RUNNING = [
    "CI runs a deterministic subset (`tests/opinfo/plan.py`: per check and eager mode one entry in N, "
    "one sample each, the data-dependent-shape entries in every mode, every listed expected failure "
    "with all its samples):",
    "",
    "```bash",
    "python -m pytest tests/opinfo                      # the CI subset",
    "python -m tests.opinfo.update                      # the full sweep: every check, mode and sample (hours)",
    "python -m tests.opinfo.update --samples 2 --checks float32,int64 --modes strict   # what this page ran",
    "python -m tests.opinfo.update --failed --write     # re-run the failures, rewrite expected_failures.toml",
    "python docs/gen_op_coverage.py                     # this page, from tests/opinfo/sweep_results.json",
    "```",
]


def _load(path: Path) -> tuple[dict, list[dict]]:
    if not path.exists():
        sys.exit(f"{path} does not exist: run `python -m tests.opinfo.update` (or pass --sweep)")
    payload = json.loads(path.read_text())
    return payload, payload["cases"]


def _check_table(records: list[dict]) -> list[str]:
    by = collections.defaultdict(collections.Counter)
    for r in records:
        by[(r["check"], r["mode"])][r["status"]] += 1
    applicable = {name: sum(check.applies_to(o) for o in harness.entries().values())
                  for name, check in harness.CHECKS.items()}
    lines = ["| check | mode | pass | fail | skipped | entries |", "|---|---|---:|---:|---:|---:|"]
    for name in harness.CHECKS:
        for mode in harness.EAGER_MODES:
            c = by.get((name, mode))
            if not c:
                continue
            failed = c["fail"] + c["timeout"] + c["crash"]
            lines.append(f"| {name} | {mode} | {c['pass']} | {failed} | {c['skip']} | {applicable[name]} |")
    return lines


def _cause(record: dict) -> str:
    detail = record.get("detail", "")
    missing = _MISSING_OP.search(detail)
    if record.get("error") == "StrictOpsError" and missing:
        return f"no native lowering: `{missing.group(1)}`"
    if record["status"] in ("timeout", "crash"):
        return record["status"]
    if record.get("error") == "Mismatch":
        return "values differ from CPU" if "not close" in detail else "result differs from CPU"
    return f"error: {record.get('error', '?')}"


def _failures(records: list[dict], expected: expectations.Expectations) -> list[str]:
    """Failing cases grouped by cause; a case failing alike in several modes is one row."""
    rows = collections.defaultdict(list)  # (cause, entry, check, reason) -> modes
    for r in records:
        if r["status"] in update._FAILED:
            reason = expected.reason(r["entry"], r["check"], r["mode"])
            reason = reason or f"(not in expected_failures.toml) {r.get('detail', '')}"
            rows[(_cause(r), r["entry"], r["check"], reason)].append(r["mode"])
    by_cause = collections.defaultdict(list)
    for (cause, entry, check, reason), modes in rows.items():
        by_cause[cause].append((entry, check, modes, reason))
    lines = []
    for cause, group in sorted(by_cause.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines += ["", f"### {cause} ({len(group)})", "", "| entry | check | modes | reason |", "|---|---|---|---|"]
        for entry, check, modes, reason in sorted(group):
            shown = "all" if set(modes) == set(harness.EAGER_MODES) else ", ".join(sorted(modes))
            text = reason.replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| `{entry}` | {check} | {shown} | {text} |")
    return lines


def _op_counts(records: list[dict]) -> tuple[list[str], set[str]]:
    lowered = coverage.lowered_overloads()
    lowered_names = {coverage.op_name(op) for op in lowered}
    decomposed = set()
    for r in records:
        if r["status"] == "pass":
            decomposed.update(r.get("decomposed", ()))
    decomposed_names = {name.removeprefix("aten.").split(".")[0].rstrip("_") for name in decomposed}
    decomposed_names -= lowered_names
    lines = [
        f"- ATen overloads with a lowering of their own (registry, reachable): **{len(lowered)}**, "
        f"over **{len(lowered_names)}** distinct ops (an op's in-place and `out=` overloads derive "
        f"from its functional lowering and are not counted again).",
        f"- Further ops run natively as PyTorch decompositions (seen in passing sweep cases, under "
        f"`TORCHTPU_STRICT_OPS=1`): **{len(decomposed_names)}** distinct ops.",
        f"- Distinct ATen ops lowered or decomposed natively: **{len(lowered_names | decomposed_names)}**.",
    ]
    return lines, decomposed_names


def _core_section() -> list[str]:
    core = coverage.core_aten_ops()
    kinds = collections.Counter()
    missing = []
    for op in core:
        kind = coverage.native_kind(op)
        kinds[kind] += 1
        if kind is None:
            missing.append(str(op))
    native = len(core) - len(missing)
    lines = [f"**{native} of {len(core)}** overloads tagged `torch.Tag.core` run natively "
             f"({100 * native / len(core):.1f}%): "
             + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: str(kv[0])) if k) + "."]
    composite = [str(op) for op in core if coverage.native_kind(op) in (coverage.DECOMPOSED, coverage.EXPLICIT_COMPOSITE)]
    if composite:
        lines += ["", "Native through what they call (a decomposition or a composite kernel), not a lowering of "
                  "their own: " + ", ".join(f"`{c}`" for c in composite) + "."]
    if missing:
        lines += ["", f"Missing ({len(missing)}): " + ", ".join(f"`{m}`" for m in missing) + "."]
    return lines


def render(payload: dict, records: list[dict]) -> str:
    expected = expectations.load(harness.CHECKS, harness.EAGER_MODES)
    strict = [r for r in records if r["mode"] == MODE]
    passing = collections.Counter(r["check"] for r in strict if r["status"] == "pass")
    shapes_only = collections.Counter(r["check"] for r in strict if r["status"] == "pass" and not r.get("values", True))
    applicable = {name: sum(check.applies_to(o) for o in harness.entries().values())
                  for name, check in harness.CHECKS.items()}
    op_lines, _ = _op_counts(records)
    runs = payload.get("runs", [])
    samples = sorted({str(run["samples"]) for run in runs if not run.get("failed_only")})
    hours = sum(run["seconds"] for run in runs) / 3600
    lines = [
        "# Op coverage",
        "",
        "Generated by `python docs/gen_op_coverage.py` from the OpInfo sweep "
        "(`python -m tests.opinfo.update`; see `tests/opinfo/README.md`) -- do not edit by hand.",
        f"torch {payload.get('torch', '?')}; samples per case: {', '.join(samples) or '?'} "
        f"({len(runs)} sweep runs, {hours:.1f} h); "
        "every run under `TORCHTPU_STRICT_OPS=1` (a CPU fallback is a failure) and `highest` "
        "matmul precision, compared with PyTorch's CPU kernels.",
        "",
        "## OpInfo entries passing natively",
        "",
        f"In `{MODE}` mode, out of the entries of torch's `op_db` each check applies to:",
        "",
    ]
    for name in harness.CHECKS:
        note = (f" ({shapes_only[name]} of them random or otherwise undefined: structure, dtypes and "
                f"shapes compared)") if shapes_only[name] else ""
        lines.append(f"- {name}: **{passing[name]} of {applicable[name]}**{note}")
    lines += ["", "By check and eager mode (skipped: every sample is sparse, or gradients of undefined "
              "values, or an eager mode that does not exist yet):", ""] + _check_table(records)
    lines += ["", "## ATen ops", ""] + op_lines
    lines += ["", "## Core ATen opset", ""] + _core_section()
    lines += ["", "## Running the sweep", ""] + RUNNING
    lines += ["", "## Failing cases", "", "Grouped by cause; the reason is the one in "
              "`tests/opinfo/expected_failures.toml`."] + _failures(records, expected)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=update.RESULTS)
    parser.add_argument("--sweep", action="store_true", help="run the full sweep first")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.sweep:
        update.main(["--results", str(args.results)])
    payload, records = _load(args.results)
    args.out.write_text(render(payload, records))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
