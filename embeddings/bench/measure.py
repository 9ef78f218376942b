"""Timing: steps of several systems interleaved, XLA compiles counted, this machine's random-row
gather bandwidth, and the per-system figures derived from them.

Steps are timed interleaved (round r runs every system's step r once), so a change in machine
load hits every system alike and the ratios stay meaningful on a shared 2-core machine. The
first `warmup` rounds are not timed; compiles are counted over every round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from embeddings.bench.systems import System

__all__ = ["SystemResult", "Timings", "XlaCompiles", "gather_bandwidth", "interleaved_times", "summarise"]

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""jax's monitoring event for one XLA compile (jax._src.dispatch.BACKEND_COMPILE_EVENT)."""


class XlaCompiles:
    """Counts XLA compiles of this process and their seconds (jax's monitoring events), whichever
    executor (eager op cache, DeferAndFuse, torch.compile, the SparseCore programs) asked."""

    _instance: XlaCompiles | None = None

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    @classmethod
    def listening(cls) -> XlaCompiles:
        """The process's counter, registered with jax on first use."""
        if cls._instance is None:
            import jax.monitoring

            cls._instance = cls()
            jax.monitoring.register_event_duration_secs_listener(cls._instance._record)
        return cls._instance

    def _record(self, event: str, duration: float, **_: object) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def snapshot(self) -> tuple[int, float]:
        return self.count, self.seconds


@dataclass
class Timings:
    """One system's measured steps: wall seconds and host-preprocessing seconds of each, and the
    XLA compiles (count, seconds) its calls caused, warm-up included, and how many of them came
    during the measured steps (a steady state compiles nothing)."""

    seconds: list[float] = field(default_factory=list)
    host_seconds: list[float] = field(default_factory=list)
    compiles: int = 0
    compile_seconds: float = 0.0
    measured_compiles: int = 0

    def add_compiles(self, before: tuple[int, float], after: tuple[int, float], measured: bool = False) -> None:
        self.compiles += after[0] - before[0]
        self.compile_seconds += after[1] - before[1]
        if measured:
            self.measured_compiles += after[0] - before[0]


def interleaved_times(
    systems: Sequence[System],
    warmup: int,
    iterations: int,
    batches: int,
    timings: dict[str, Timings],
    advance: Callable[[], None] = lambda: None,
) -> None:
    """`warmup` untimed then `iterations` timed rounds; round r runs every system on batch
    r mod `batches`. Adds to `timings[system.name]`; `advance` is called after every step."""
    compiles = XlaCompiles.listening()
    for round_index in range(warmup + iterations):
        for system in systems:
            record = timings[system.name]
            before = compiles.snapshot()
            start = time.perf_counter()
            host = system.step(round_index % batches)
            elapsed = time.perf_counter() - start
            measured = round_index >= warmup
            record.add_compiles(before, compiles.snapshot(), measured)
            if measured:
                record.seconds.append(elapsed)
                record.host_seconds.append(host)
            advance()


def gather_bandwidth(rows: int, dim: int, count: int, seed: int, repeats: int = 10) -> float:
    """This machine's random-row gather rate in GB/s of rows: `torch.index_select` of `count`
    uniformly random rows of a `[rows, dim]` float32 table into a preallocated output (torch's
    threads; uniform ids miss the caches most). Median of `repeats`."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.rand(rows, dim, generator=generator)
    ids = torch.randint(0, rows, (count,), generator=generator)
    out = torch.empty(count, dim)
    torch.index_select(table, 0, ids, out=out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.index_select(table, 0, ids, out=out)
        times.append(time.perf_counter() - start)
    return count * dim * 4 / statistics.median(times) / 1e9


@dataclass(frozen=True)
class SystemResult:
    """One system's figures. `vs_fbgemm` is its p50 step time over FBGEMM's (below 1: faster);
    `gb_per_s` counts the embedding rows the lookups address (lookups x dim x 4 bytes per step);
    `gather_share` is that rate over this machine's random-row gather rate. `compiles` counts
    XLA compiles from the first call on, `measured_compiles` those during the measured steps;
    `host_share` is the share of the step spent preprocessing on the host."""

    system: str
    p50_ms: float
    p90_ms: float
    lookups_per_s: float
    gb_per_s: float
    vs_fbgemm: float
    compile_s: float
    compiles: int
    measured_compiles: int
    host_share: float
    gather_share: float


def summarise(timings: dict[str, Timings], lookups: float, dim: int, gather_gb_per_s: float) -> list[SystemResult]:
    """Per-system figures from the timings; `lookups` is the mean ids per (global) step."""
    p50 = {name: float(np.percentile(t.seconds, 50)) for name, t in timings.items()}
    results = []
    for name, t in timings.items():
        rate = lookups / p50[name]
        gb_per_s = rate * dim * 4 / 1e9
        results.append(
            SystemResult(
                system=name,
                p50_ms=p50[name] * 1e3,
                p90_ms=float(np.percentile(t.seconds, 90)) * 1e3,
                lookups_per_s=rate,
                gb_per_s=gb_per_s,
                vs_fbgemm=p50[name] / p50["fbgemm"],
                compile_s=t.compile_seconds,
                compiles=t.compiles,
                measured_compiles=t.measured_compiles,
                host_share=sum(t.host_seconds) / sum(t.seconds),
                gather_share=gb_per_s / gather_gb_per_s,
            )
        )
    return results
