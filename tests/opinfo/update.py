"""Run the OpInfo sweep outside pytest, record every case's outcome, optionally rewrite the
expected failures from it.

    python -m tests.opinfo.update                      # full sweep -> tests/opinfo/sweep_results.json
    python -m tests.opinfo.update --write              # ... and rewrite expected_failures.toml
    python -m tests.opinfo.update --checks float32 --modes strict --samples 4 -k linalg
    python -m tests.opinfo.update --failed          # re-run only the cases recorded as failed

Cases run in worker processes (`--jobs`), one entry's cases after another so a worker reuses its
compiled programs; a case that runs longer than `--timeout` or kills its worker is recorded as
such and the worker is replaced, so one bad op cannot stop the sweep. Results merge into the
results file by case, so partial sweeps refine it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Iterable

# The test session's device set-up (tests/conftest.py), before jax starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TORCHTPU_NUM_DEVICES", "4")

import torch  # noqa: E402

from . import expectations, harness  # noqa: E402

RESULTS = Path(__file__).parent / "sweep_results.json"
_CASES_PER_WORKER = 400  # then a fresh worker, to bound the memory of compiled programs
_FAILED = ("fail", "timeout", "crash")


# --- worker side ---------------------------------------------------------------------------------


def _outcome(entry: str, check_name: str, mode: str, samples: int | None, budget: float | None) -> dict:
    record: dict[str, Any] = {"entry": entry, "check": check_name, "mode": mode}
    opinfo, check = harness.entries()[entry], harness.CHECKS[check_name]
    start = time.perf_counter()
    try:
        unavailable = harness.mode_unavailable(mode)
        if unavailable:
            return record | {"status": "skip", "detail": unavailable}
        result = harness.run_case(opinfo, check, mode, harness.Selection(samples, budget))
    except harness.CaseFailure as failure:
        error = type(failure.error).__name__ if isinstance(failure, harness.DeviceFailure) else "Mismatch"
        record |= {"status": "fail", "error": error, "detail": failure.detail, "where": failure.where}
    except Exception as error:  # noqa: BLE001 -- a harness-level error is recorded, not fatal
        detail = (str(error).strip().splitlines() or [""])[0]
        record |= {"status": "fail", "error": type(error).__name__, "detail": detail}
    else:
        record |= {"status": "pass" if result.checked else "skip", "checked": result.checked,
                   "values": result.values_compared, "decomposed": sorted(result.decomposed_ops)}
        if result.skipped:
            record["skipped"] = result.skipped
        if not result.checked:
            record["detail"] = f"no sample to compare: {result.skipped}"
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def _worker(conn: Connection, index: int, samples: int | None, budget: float | None) -> None:
    import warnings

    from torchtpu import runtime

    warnings.filterwarnings("ignore")
    # On a TPU each worker owns one chip (UNTESTED: no TPU here). On the CPU stand-in every worker
    # is a separate runtime whose tpu:0 is its own, so all use tpu:0 and the lock is off for them.
    device = index if runtime.runtime().platform == "tpu" else 0
    try:
        harness.use_device(device)
    except Exception as error:  # noqa: BLE001 -- reported to the parent, which stops the sweep
        conn.send(("fatal", f"worker {index} on tpu:{device}: {type(error).__name__}: {error}"))
        return
    for _ in range(_CASES_PER_WORKER):
        case = conn.recv()
        if case is None:
            break
        conn.send(("done", _outcome(*case, samples, budget)))
    conn.send(("retire", None))


# --- parent side ---------------------------------------------------------------------------------


class _Slot:
    """Worker process `index` and the case it is running."""

    def __init__(self, ctx, index: int, samples: int | None, budget: float | None) -> None:
        self.index = index
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, index, samples, budget), daemon=True)
        self.process.start()
        child.close()
        self.case: tuple | None = None
        self.started = 0.0
        self.pending: list[tuple] = []  # this worker's remaining cases of its current entry


def _plan(checks: Iterable[str], modes: Iterable[str], selector: str | None,
          only: set[tuple] | None) -> list[list[tuple]]:
    """Cases grouped by entry: [[(entry, check, mode), ...], ...] (of `only`, if given)."""
    groups = []
    for entry, opinfo in harness.entries().items():
        if selector and selector not in entry:
            continue
        group = [(entry, check, mode) for check in checks if harness.CHECKS[check].applies_to(opinfo)
                 for mode in modes if only is None or (entry, check, mode) in only]
        if group:
            groups.append(group)
    return groups


def sweep(checks: list[str], modes: list[str], samples: int | None, budget: float | None, jobs: int,
          timeout: float, selector: str | None = None, only: set[tuple] | None = None,
          log=sys.stderr) -> list[dict]:
    """Run every case (of `only`, if given) and return one record per case."""
    groups = _plan(checks, modes, selector, only)
    total = sum(len(g) for g in groups)
    # Workers spawn (never fork a process that runs jax); the parent never touches a device.
    os.environ.setdefault("TORCHTPU_LOCK_DIR", tempfile.mkdtemp(prefix="torchtpu-sweep-locks-"))
    os.environ["TORCHTPU_DEVICE_LOCK"] = "0"  # ignored on a TPU, where each worker owns a chip
    ctx = multiprocessing.get_context("spawn")
    slots = [_Slot(ctx, index, samples, budget) for index in range(jobs)]
    records: list[dict] = []
    start = time.perf_counter()

    def feed(slot: _Slot) -> None:
        if not slot.pending and groups:
            slot.pending = groups.pop(0)
        if slot.pending:
            slot.case = slot.pending.pop(0)
            slot.started = time.perf_counter()
            slot.conn.send(slot.case)
        else:
            slot.case = None

    def replace(slot: _Slot, status: str, detail: str) -> _Slot:
        entry, check, mode = slot.case
        records.append({"entry": entry, "check": check, "mode": mode, "status": status,
                        "detail": detail, "seconds": round(time.perf_counter() - slot.started, 3)})
        slot.process.kill()
        slot.process.join()
        fresh = _Slot(ctx, slot.index, samples, budget)
        fresh.pending = slot.pending
        feed(fresh)
        return fresh

    for slot in slots:
        feed(slot)
    while any(slot.case is not None for slot in slots):
        ready = wait([s.conn for s in slots if s.case is not None], timeout=5.0)
        for i, slot in enumerate(slots):
            if slot.case is None:
                continue
            if slot.conn in ready:
                try:
                    kind, payload = slot.conn.recv()
                except EOFError:
                    slot.process.join(timeout=10)
                    slots[i] = replace(slot, "crash", f"worker died (exit code {slot.process.exitcode})")
                    continue
                if kind == "fatal":
                    for other in slots:
                        other.process.kill()
                    raise RuntimeError(payload)
                if kind == "done":
                    records.append(payload)
                    if len(records) % 50 == 0:
                        elapsed = time.perf_counter() - start
                        print(f"[sweep] {len(records)}/{total} cases, {elapsed:.0f}s", file=log, flush=True)
                    feed(slot)
                elif kind == "retire":
                    slot.process.join()
                    fresh = _Slot(ctx, slot.index, samples, budget)
                    fresh.pending = [slot.case, *slot.pending]
                    feed(fresh)
                    slots[i] = fresh
            elif time.perf_counter() - slot.started > timeout:
                slots[i] = replace(slot, "timeout", f"no result within {timeout:.0f}s")
            elif not slot.process.is_alive():
                slots[i] = replace(slot, "crash", f"worker died (exit code {slot.process.exitcode})")
    for slot in slots:
        if slot.process.is_alive():
            slot.conn.send(None)
            slot.process.join(timeout=30)
    return records


def merge(path: Path, records: list[dict]) -> list[dict]:
    """The results file's records with those of this run replacing the same cases."""
    old = json.loads(path.read_text())["cases"] if path.exists() else []
    key = lambda r: (r["entry"], r["check"], r["mode"])  # noqa: E731
    merged = {key(r): r for r in old}
    merged.update((key(r), r) for r in records)
    return sorted(merged.values(), key=key)


def failed_cases(path: Path) -> set[tuple]:
    """(entry, check, mode) of the cases the results file records as failed."""
    if not path.exists():
        return set()
    return {(r["entry"], r["check"], r["mode"]) for r in json.loads(path.read_text())["cases"]
            if r["status"] in _FAILED}


def save(path: Path, records: list[dict], runs: list[dict]) -> None:
    payload = {"torch": torch.__version__, "runs": runs, "cases": records}
    path.write_text(json.dumps(payload, indent=0, sort_keys=True) + "\n")


def _placeholder(record: dict) -> str:
    text = f"{record.get('error', record['status'])}: {record.get('detail', '')}".strip()
    return text if len(text) <= 200 else text[:197] + "..."


def expected_from(records: list[dict], previous: dict, all_modes: Iterable[str]) -> dict:
    """Expected failures after a sweep: `previous` reasons ({(check, mode|None, entry): reason}),
    with the cases this sweep ran replaced by its outcome. A case failing in every available mode
    gets one shared line; otherwise one line per failing mode. Reasons already written are kept;
    new failures get the error's first line as a placeholder reason to edit."""
    reasons = dict(previous)
    by_case: dict[tuple[str, str], dict[str, dict]] = {}
    for r in records:
        by_case.setdefault((r["entry"], r["check"]), {})[r["mode"]] = r
    for (entry, check), per_mode in by_case.items():
        ran = {m for m, r in per_mode.items() if r["status"] != "skip"}
        failing = {m: r for m, r in per_mode.items() if r["status"] in _FAILED}
        unavailable = {m for m, r in per_mode.items() if r["status"] == "skip" and r["detail"].startswith("eager mode")}
        shared = reasons.pop((check, None, entry), None)
        old = {m: reasons.pop((check, m, entry)) for m in all_modes if (check, m, entry) in reasons}
        fallback = shared or next(iter(old.values()), None)
        for mode in set(all_modes) - ran - unavailable:
            if mode in old or shared:  # a mode this sweep did not run keeps its expectation
                reasons[(check, mode, entry)] = old.get(mode) or shared
        available = set(all_modes) - unavailable
        if failing and set(failing) == available:
            reasons[(check, None, entry)] = fallback or _placeholder(next(iter(failing.values())))
            continue
        for mode, record in failing.items():
            reasons[(check, mode, entry)] = old.get(mode) or fallback or _placeholder(record)
    return reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", default=",".join(harness.CHECKS), help="comma-separated checks")
    parser.add_argument("--modes", default=",".join(harness.EAGER_MODES), help="comma-separated eager modes")
    parser.add_argument("--samples", default="all", help="samples per entry (default: all)")
    parser.add_argument("--budget", type=float, default=None, help="seconds per case before no new sample starts")
    parser.add_argument("-k", dest="selector", default=None, help="only entries whose name contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case before it is killed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--failed", action="store_true", help="only the cases the results file records as failed")
    parser.add_argument("--write", action="store_true", help="rewrite expected_failures.toml")
    args = parser.parse_args(argv)
    checks = [c for c in args.checks.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(checks) - set(harness.CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; expected some of {list(harness.CHECKS)}")
    samples = None if args.samples == "all" else int(args.samples)
    start = time.perf_counter()
    only = failed_cases(args.results) if args.failed else None
    records = sweep(checks, modes, samples, args.budget, args.jobs, args.timeout, args.selector, only)
    elapsed = time.perf_counter() - start
    run = {"checks": checks, "modes": modes, "samples": args.samples, "budget": args.budget,
           "selector": args.selector, "failed_only": args.failed, "jobs": args.jobs,
           "cases": len(records), "seconds": round(elapsed)}
    runs = json.loads(args.results.read_text()).get("runs", []) if args.results.exists() else []
    save(args.results, merge(args.results, records), runs + [run])
    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"[sweep] {len(records)} cases in {elapsed:.0f}s: {counts} -> {args.results}")
    if args.write:
        previous = expectations.load(tuple(harness.CHECKS), harness.EAGER_MODES).reasons
        reasons = expected_from(records, previous, harness.EAGER_MODES)
        expectations.PATH.write_text(expectations.render(reasons, tuple(harness.CHECKS), harness.EAGER_MODES))
        print(f"[sweep] wrote {len(reasons)} expected failures -> {expectations.PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
