"""One benchmark point: build the workload and the systems, check that they compute the same
pooled embeddings, time them, and derive the figures.

With several processes every process runs the tpu system on its samples (its programs span
every process's devices); process 0 alone also runs the baselines, on the whole global batch,
after the tpu steps (the other processes wait), and reports.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from embeddings.bench.measure import SystemResult, Timings, XlaCompiles, gather_bandwidth, interleaved_times, summarise
from embeddings.bench.options import BenchConfig
from embeddings.bench.systems import EmbeddingBagSystem, FbgemmSystem, System, TorchRecSystem, TpuSystem
from embeddings.bench.workload import POOL, calibrated_configs, make_workload
from embeddings.modules import runtime_topology

__all__ = ["OutputMismatchError", "PointResult", "SYSTEMS", "check_outputs", "run_point"]

SYSTEMS = ("tpu", "fbgemm", "embedding_bag", "torchrec")
RELATIVE_TOLERANCE = 1e-5
"""Of the largest pooled value: float32 sums in another order differ by far less; a wrong row
or a missed id differs by about one row's values, far more."""


class OutputMismatchError(RuntimeError):
    """A system's pooled output differs from FBGEMM's on the same ids and weights."""


@dataclass(frozen=True)
class PointResult:
    """Everything measured at one benchmark point (reported by process 0). `load_average` is the
    machine's 1-minute load average after the timing: other processes move every number."""

    config: BenchConfig
    lookups_per_step: float
    gather_gb_per_s: float
    load_average: float
    systems: tuple[SystemResult, ...]


def run_point(config: BenchConfig, rank: int, world: int, advance: Callable[[], None]) -> PointResult | None:
    """Run one point; the result on process 0, None on the others."""
    workload = make_workload(config)
    topology = runtime_topology(config.sparsecores_per_device)
    compiles = XlaCompiles.listening()
    timings = {name: Timings() for name in SYSTEMS}
    tpu = TpuSystem(workload, calibrated_configs(workload, topology), topology, rank)
    weights = tpu.weights()
    before = compiles.snapshot()
    tpu_pooled = _all_samples(tpu.pooled(0), world)
    timings["tpu"].add_compiles(before, compiles.snapshot())
    baselines: list[System] = []
    problem = None
    if rank == 0:
        baselines = [FbgemmSystem(workload, weights), EmbeddingBagSystem(workload, weights),
                     TorchRecSystem(workload, weights)]
        try:
            check_outputs(baselines[0].pooled(0), {"tpu": tpu_pooled, **{b.name: b.pooled(0) for b in baselines[1:]}},
                          config.dim)
        except OutputMismatchError as error:
            problem = str(error)
    problem = _from_rank_zero(problem, world)
    if problem is not None:
        raise OutputMismatchError(problem)
    if world == 1:
        interleaved_times([tpu, *baselines], config.warmup, config.iterations, POOL, timings, advance)
    else:
        interleaved_times([tpu], config.warmup, config.iterations, POOL, timings, advance)
        dist.barrier()
        interleaved_times(baselines, config.warmup, config.iterations, POOL, timings, advance)
        dist.barrier()
    if rank != 0:
        return None
    lookups = workload.mean_lookups
    gather = gather_bandwidth(max(config.rows), config.dim, round(lookups), config.seed)
    systems = tuple(summarise(timings, lookups, config.dim, gather))
    return PointResult(config, lookups, gather, os.getloadavg()[0], systems)


def check_outputs(reference: torch.Tensor, outputs: dict[str, torch.Tensor], dim: int) -> None:
    """Raise `OutputMismatchError` naming the first value of any output that differs from FBGEMM's
    `reference` by more than `RELATIVE_TOLERANCE` of the largest reference value."""
    tolerance = RELATIVE_TOLERANCE * max(float(reference.abs().max()), 1e-30)
    for name, output in outputs.items():
        if output.shape != reference.shape:
            raise OutputMismatchError(
                f"{name}'s pooled output of the first batch has shape {tuple(output.shape)}, FBGEMM's "
                f"{tuple(reference.shape)}"
            )
        difference = (output - reference).abs()
        wrong = difference > tolerance
        if wrong.any():
            sample, column = (int(i) for i in wrong.nonzero()[0])
            raise OutputMismatchError(
                f"{name}'s pooled output of the first batch differs from FBGEMM's on the same ids and weights: "
                f"{int(wrong.sum())} of {wrong.numel()} values, first at sample {sample}, table t{column // dim} "
                f"column {column % dim}: {float(output[sample, column]):.8g} vs {float(reference[sample, column]):.8g} "
                f"(tolerance {tolerance:.3g}); a benchmark of a wrong computation is meaningless, so nothing was timed"
            )


def _all_samples(local: torch.Tensor, world: int) -> torch.Tensor:
    """Every process's rows of the pooled output, in sample order (on every process)."""
    if world == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    return torch.cat(parts)


def _from_rank_zero(value: str | None, world: int) -> str | None:
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
