"""The expected failures of the OpInfo sweep: one TOML file, one reason per failing case.

    [float32]                     # a check: fails in every eager mode
    "linalg.eigh" = "reason"
    [defer.grad]                  # a check in one eager mode only
    "cumsum" = "reason"

A listed case runs as a strict xfail: it must fail, so an op that starts passing fails the suite
until its line is removed (`python -m tests.opinfo.update --write` does that from a sweep).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

PATH = Path(__file__).parent / "expected_failures.toml"

_HEADER = """\
# Expected failures of the OpInfo sweep (tests/opinfo). One reason per case, written for a
# reviewer. [<check>] lists cases that fail in every eager mode; [<mode>.<check>] cases that fail
# in that mode only. Regenerate from a full sweep: python -m tests.opinfo.update --write
# (reasons of cases that still fail are kept; new ones start as the error's first line).
"""


@dataclass(frozen=True)
class Expectations:
    """`reasons[(check, mode or None, entry)]` = why that case fails."""

    reasons: Mapping[tuple[str, str | None, str], str]

    def reason(self, entry: str, check: str, mode: str) -> str | None:
        return self.reasons.get((check, mode, entry)) or self.reasons.get((check, None, entry))

    def entries(self) -> set[str]:
        return {entry for _, _, entry in self.reasons}


def parse(text: str, checks: Iterable[str], modes: Iterable[str]) -> Expectations:
    checks, modes = set(checks), set(modes)
    reasons: dict[tuple[str, str | None, str], str] = {}
    for table, body in tomllib.loads(text).items():
        if table in checks:
            reasons.update(_entries(table, None, body))
        elif table in modes:
            unknown = set(body) - checks
            if unknown:
                raise ValueError(f"{PATH.name}: [{table}] has unknown checks {sorted(unknown)}")
            for check, entries in body.items():
                reasons.update(_entries(check, table, entries))
        else:
            raise ValueError(
                f"{PATH.name}: unknown table [{table}]; expected a check {sorted(checks)} "
                f"or a mode {sorted(modes)}"
            )
    return Expectations(reasons)


def _entries(check: str, mode: str | None, entries: Mapping[str, object]):
    for entry, reason in entries.items():
        if not isinstance(reason, str) or not reason.strip():
            where = f"[{mode}.{check}]" if mode else f"[{check}]"
            raise ValueError(f"{PATH.name}: {where} {entry!r} needs a non-empty reason string")
        yield (check, mode, entry), reason


def load(checks: Iterable[str], modes: Iterable[str]) -> Expectations:
    return parse(PATH.read_text(), checks, modes)


def render(reasons: Mapping[tuple[str, str | None, str], str], checks: Iterable[str],
           modes: Iterable[str]) -> str:
    """The TOML text for `reasons`, tables in `checks` order, then per mode; entries sorted."""
    lines = [_HEADER]
    for mode in (None, *modes):
        for check in checks:
            rows = sorted((e, r) for (c, m, e), r in reasons.items() if c == check and m == mode)
            if not rows:
                continue
            lines.append(f"[{mode}.{check}]" if mode else f"[{check}]")
            lines.extend(f"{_quote(entry)} = {_quote(reason)}" for entry, reason in rows)
            lines.append("")
    return "\n".join(lines)


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{escaped}"'
