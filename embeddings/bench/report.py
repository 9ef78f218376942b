"""The benchmark's outputs: a table per point on stdout, JSON, CSV, and a sweep's plot."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
from collections.abc import Sequence

from embeddings.bench.measure import SystemResult
from embeddings.bench.options import BenchConfig, Sweep
from embeddings.bench.runner import PointResult

__all__ = ["COLUMNS", "plot", "table", "write_csv", "write_json"]

COLUMNS = (
    ("system", "system", "{}"),
    ("p50_ms", "p50 ms", "{:.2f}"),
    ("p90_ms", "p90 ms", "{:.2f}"),
    ("lookups_per_s", "lookups/s", "{:.3g}"),
    ("gb_per_s", "GB/s rows", "{:.3g}"),
    ("vs_fbgemm", "time / FBGEMM", "{:.2f}x"),
    ("compile_s", "compile s", "{:.2f}"),
    ("compiles", "compiles", "{}"),
    ("measured_compiles", "in measured", "{}"),
    ("host_share", "host prep", "{:.0%}"),
    ("gather_share", "of gather BW", "{:.0%}"),
)
"""(SystemResult field, heading, format) of every column, in order."""


def table(point: PointResult, markdown: bool = False) -> str:
    """The point's results as an aligned text table (or a Markdown table)."""
    headings = [heading for _, heading, _ in COLUMNS]
    rows = [[fmt.format(getattr(result, key)) for key, _, fmt in COLUMNS] for result in point.systems]
    lines = [
        point.config.describe(),
        f"{point.lookups_per_step:.0f} lookups per step; this machine's random-row gather: "
        f"{point.gather_gb_per_s:.2f} GB/s; load average {point.load_average:.1f} on {os.cpu_count()} cores",
    ]
    if markdown:
        lines += ["", "| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headings)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(headings, widths)))
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _config_fields(config: BenchConfig) -> dict[str, object]:
    fields = dataclasses.asdict(config)
    fields["rows"] = list(config.rows)
    fields["ids_per_bag"] = str(config.ids_per_bag)
    fields["id_distribution"] = str(config.id_distribution)
    return fields


def _machine() -> dict[str, object]:
    import jax
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "jax": jax.__version__, "platform": platform.platform()}


def write_json(path: str, points: Sequence[PointResult], sweep: Sweep | None) -> None:
    """Every point: its config, lookups per step, the gather bandwidth and each system's figures."""
    document = {
        "machine": _machine(),
        "sweep": None if sweep is None else {"key": sweep.key, "values": list(sweep.values)},
        "points": [
            {
                "config": _config_fields(point.config),
                "sweep_value": None if sweep is None else sweep.values[i],
                "lookups_per_step": point.lookups_per_step,
                "gather_gb_per_s": point.gather_gb_per_s,
                "load_average": point.load_average,
                "systems": [dataclasses.asdict(result) for result in point.systems],
            }
            for i, point in enumerate(points)
        ],
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


def write_csv(path: str, points: Sequence[PointResult], sweep: Sweep | None) -> None:
    """One row per (point, system): the sweep value, the config, the point's figures, the system's."""
    metrics = [f.name for f in dataclasses.fields(SystemResult)]
    config_keys = list(_config_fields(points[0].config))
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sweep_key", "sweep_value", *config_keys, "lookups_per_step", "gather_gb_per_s", "load_average",
                         *metrics])
        for i, point in enumerate(points):
            config = _config_fields(point.config)
            for result in point.systems:
                writer.writerow([
                    "" if sweep is None else sweep.key,
                    "" if sweep is None else sweep.values[i],
                    *(config[key] for key in config_keys),
                    point.lookups_per_step,
                    point.gather_gb_per_s,
                    point.load_average,
                    *(getattr(result, key) for key in metrics),
                ])


def plot(path: str, points: Sequence[PointResult], sweep: Sweep) -> None:
    """Lookups/s of every system against the swept value (log scale), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    numeric = all(_is_number(v) for v in sweep.values)
    xs = [float(v) for v in sweep.values] if numeric else list(range(len(sweep.values)))
    figure, axes = pyplot.subplots(figsize=(7, 4.5), dpi=120)
    for name in [result.system for result in points[0].systems]:
        rates = [next(r.lookups_per_s for r in point.systems if r.system == name) for point in points]
        axes.plot(xs, rates, marker="o", label=name)
    if numeric and min(xs) > 0 and max(xs) / min(xs) >= 8:
        axes.set_xscale("log")
    axes.set_xticks(xs, sweep.values)
    axes.minorticks_off()
    axes.set_yscale("log")
    axes.set_xlabel(sweep.key)
    axes.set_ylabel("lookups / s (p50 step)")
    config = points[0].config
    work = f"training, fused {config.optimizer}" if config.training else "forward only"
    axes.set_title(f"{work}, {config.id_distribution} ids, {config.eager_mode} mode; sweep over {sweep.key}", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    pyplot.close(figure)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
