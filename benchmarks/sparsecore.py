"""SparseCore stand-in kernels against FBGEMM's CPU table-batched embedding, on the same ids.

Workload (the issue's): 8 tables of 100k or 1M rows, dim 64 or 128, batch 2048, 20 ids per bag,
Zipf(1.05) ids (hashed ranks, as `benchmarks/sparsecore_preprocess.py` draws them), sum pooling,
all 8 tables stacked into one SparseCore stack. Limits come from one warm-up pass
(`update_limits`, margin 1.2). For each configuration it prints median milliseconds of

* FBGEMM (`SplitTableBatchedEmbeddingBagsCodegen`, HOST/CPU, fp32): forward, and forward +
  backward + fused EXACT_SGD / EXACT_ROWWISE_ADAGRAD, each with torch's default thread count and
  with one thread, keeping the faster (its OpenMP regions spin badly when the cores are shared);
* the device step of `sparsecore.api.SparseCoreEmbedding` (lookup; lookup + fused update) on
  buffers already on the device;
* host preprocessing (`sparsecore.preprocess.preprocess` + `put_batch`) of the same batch, on
  `--threads` threads (default: every core, as an input pipeline would use the host): for the
  forward without the unique-row side-car (a lookup does not read it), for training with it;

and the ratios device / FBGEMM and (preprocessing + device) / FBGEMM. Ratios, not absolute times,
are the result: the steps of one configuration are timed interleaved (one repeat of each in turn),
so a change in machine load hits all of them alike, and each ratio is the median of the per-round
ratios (steps of one round ran under the same load; a median of medians would pair times taken
under different loads). Within a round each step runs `--runs` + 1 times in a row and its time
is the median of the last `--runs` calls: its steady state, with its own tables' hot rows back
in the caches, as a training loop calling it every step has them. One warm-up call is not
enough for that: on one device at 100k x 64, calls 1-6 of our forward right after FBGEMM's
took 3.5 3.1 2.8 2.7 2.7 2.6 ms, and FBGEMM's right after ours 4.6 4.0 3.6 3.3 3.3 3.3 ms
(medians of 20 sequences). Timing one call per round (`--runs 1`: the second in a row) is
therefore uneven: FBGEMM's one-thread step runs right after its default step, on the same
tables, so it is timed at its fourth call in a row and every other step at its second. The load
average (1 minute) is printed after each configuration, since other processes on a small
machine move every number.

    python benchmarks/sparsecore.py [--rows 100000 1000000] [--dims 64 128] [--repeats 10] [--runs 5]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script, this file's directory comes first on sys.path, where this file would
    # stand in for the `sparsecore` package it measures.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# Idle OpenMP workers otherwise spin after each parallel region, stealing the cores from whichever
# step runs next in the interleaved timing. Read when torch loads OpenMP, so before anything
# imports torch (`embeddings` does).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax
import jax.numpy as jnp
import numpy as np

from embeddings.bench.workload import zipf_ids
from sparsecore import optimizers
from sparsecore.api import SparseCoreEmbedding
from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import RaggedIds, preprocess, update_limits
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

TABLES = 8
BATCH = 2048
IDS_PER_BAG = 20
LEARNING_RATE = 0.01


def interleaved_times(steps: dict[str, Callable[[], object]], repeats: int, runs: int) -> dict[str, list[float]]:
    """Wall milliseconds of each step in each of `repeats` rounds, after one warm-up call each
    (which compiles); a round runs every step `runs + 1` times in a row and keeps the median of
    the last `runs`, so the steps of a round share its load and each finds its own data in the
    caches."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            step()
            timed = []
            for _ in range(runs):
                start = time.perf_counter()
                step()
                timed.append((time.perf_counter() - start) * 1e3)
            times[name].append(float(np.median(timed)))
    return times


def _row(step: str, times: dict[str, list[float]], ours: str, host: str, fbgemm: str) -> tuple:
    """(step, FBGEMM ms, device ms, host ms, device/FBGEMM, total/FBGEMM): medians of the times,
    and ratios as medians of the per-round ratios (each round's steps ran under the same load).
    FBGEMM's time in a round is the faster of its default thread count and one thread."""
    baseline = np.minimum(times[fbgemm], times[f"{fbgemm} 1 thread"])
    device, prep = np.asarray(times[ours]), np.asarray(times[host])
    return (
        step,
        float(np.median(baseline)),
        float(np.median(device)),
        float(np.median(prep)),
        float(np.median(device / baseline)),
        float(np.median((device + prep) / baseline)),
    )


def workload(rows: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = [zipf_ids(rng, rows, BATCH * IDS_PER_BAG).astype(np.int32) for _ in range(TABLES)]
    grads = [rng.normal(size=(BATCH, dim)).astype(np.float32) for _ in range(TABLES)]
    return ids, grads


class Fbgemm:
    """FBGEMM's CPU TBE over the same tables and ids (the baseline)."""

    def __init__(self, rows: int, dim: int, optimizer: str, ids, grads) -> None:
        import fbgemm_gpu  # noqa: F401  (registers the ops)
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.torch = torch
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * TABLES,
            optimizer=getattr(EmbOptimType, optimizer),
            learning_rate=LEARNING_RATE,
            pooling_mode=PoolingMode.SUM,
        )
        self.indices = torch.from_numpy(np.concatenate(ids).astype(np.int64))
        self.offsets = torch.arange(0, TABLES * BATCH * IDS_PER_BAG + 1, IDS_PER_BAG, dtype=torch.int64)
        self.grad = torch.from_numpy(np.concatenate(grads, axis=1))

    def forward(self) -> None:
        with self.torch.no_grad():
            self.tbe(self.indices, self.offsets)

    def train_step(self) -> None:
        self.tbe(self.indices, self.offsets).backward(self.grad)

    def single_threaded(self, step: Callable[[], None]) -> Callable[[], None]:
        """`step` run with one torch thread (its OpenMP regions can spin on shared cores)."""

        def run() -> None:
            threads = self.torch.get_num_threads()
            self.torch.set_num_threads(1)
            try:
                step()
            finally:
                self.torch.set_num_threads(threads)

        return run


class SparseCore:
    """The SparseCore stand-in over the same tables and ids."""

    def __init__(
        self, rows: int, dim: int, optimizer: optimizers.OptimizerSpec, topology: Topology, ids, grads, threads: int
    ) -> None:
        generous = BATCH * IDS_PER_BAG  # for the warm-up pass, which then sets the real limits
        tables = [
            TableSpec(f"table_{t}", rows, dim, optimizer=optimizer, max_ids_per_partition=generous, max_unique_ids_per_partition=generous)
            for t in range(TABLES)
        ]
        features = [FeatureSpec(f"feature_{t}", tables[t], BATCH) for t in range(TABLES)]
        lengths = np.full(BATCH, IDS_PER_BAG)
        self.inputs = {f.name: RaggedIds(ids[t], lengths=lengths) for t, f in enumerate(features)}
        self.topology = topology
        self.threads = threads
        stacks = stack_tables(features, topology, [StackGroup(tuple(t.name for t in tables))])
        warm = preprocess(stacks, self.inputs, topology)
        self.stacks = tuple(update_limits(s, warm[s.name].stats, margin=1.2) for s in stacks)
        self.engine = SparseCoreEmbedding(self.stacks, topology)
        self.tables, self.slots = self.engine.init(jax.random.key(0))
        self.batch = self.host_step()
        self.grads = {f.name: jnp.asarray(grads[t]) for t, f in enumerate(features)}

    def host_step(self, with_unique_rows: bool = True):
        """Preprocess the batch and move it to the device: with the side-car for training,
        without it for a lookup."""
        packed = preprocess(
            self.stacks, self.inputs, self.topology, with_unique_rows=with_unique_rows, num_threads=self.threads
        )
        return self.engine.put_batch(packed)

    def host_lookup_step(self):
        return self.host_step(with_unique_rows=False)

    def forward(self) -> None:
        jax.block_until_ready(self.engine.lookup(self.tables, self.batch))

    def train_step(self) -> None:
        activations = self.engine.lookup(self.tables, self.batch)
        self.tables, self.slots = self.engine.update(self.tables, self.slots, self.batch, self.grads)
        jax.block_until_ready((activations, self.tables, self.slots))


def run(rows: int, dim: int, topology: Topology, repeats: int, runs: int, threads: int) -> list[tuple]:
    """Rows (step, FBGEMM ms, device ms, host ms, device/FBGEMM, total/FBGEMM) of one
    configuration (see `_row`)."""
    ids, grads = workload(rows, dim)
    results = []
    for label, fbgemm_name, spec in (
        ("SGD", "EXACT_SGD", optimizers.SGD(learning_rate=LEARNING_RATE)),
        ("row-wise Adagrad", "EXACT_ROWWISE_ADAGRAD", optimizers.RowWiseAdagrad(learning_rate=LEARNING_RATE)),
    ):
        ours = SparseCore(rows, dim, spec, topology, ids, grads, threads)
        baseline = Fbgemm(rows, dim, fbgemm_name, ids, grads)
        steps = {
            "host": ours.host_step,
            "train": ours.train_step,
            "fbgemm train": baseline.train_step,
            "fbgemm train 1 thread": baseline.single_threaded(baseline.train_step),
        }
        if not results:
            steps.update(
                {
                    "host lookup": ours.host_lookup_step,
                    "forward": ours.forward,
                    "fbgemm forward": baseline.forward,
                    "fbgemm forward 1 thread": baseline.single_threaded(baseline.forward),
                }
            )
        times = interleaved_times(steps, repeats, runs)
        if not results:
            results.append(_row("forward", times, "forward", "host lookup", "fbgemm forward"))
        results.append(_row(f"fwd+bwd+{label}", times, "train", "host", "fbgemm train"))
        del ours, baseline, steps  # free both copies of the tables before the next pair
        gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--devices", type=int, default=1, help="stand-in devices (JAX CPU devices)")
    parser.add_argument("--sparsecores", type=int, default=4, help="SparseCores per stand-in device")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5, help="timed calls in a row per step and round")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="threads of host preprocessing (default: every core)"
    )
    args = parser.parse_args()
    topology = Topology.cpu(args.devices, args.sparsecores)
    print(
        f"{TABLES} tables, batch {BATCH}, {IDS_PER_BAG} ids/bag, Zipf(1.05), sum pooling; stand-in: "
        f"{args.devices} device(s) x {args.sparsecores} SparseCores; host preprocessing on "
        f"{args.threads} thread(s); medians of {args.repeats} rounds of {args.runs} call(s); ms; load average at "
        f"start {_load()}"
    )
    header = f"{'rows':>9} {'dim':>4}  {'step':<26}{'FBGEMM':>8}{'device':>9}{'host prep':>11}{'prep+dev':>10}{'device/FB':>11}{'total/FB':>10}"
    print(header)
    for rows in args.rows:
        for dim in args.dims:
            for step, fbgemm_ms, device_ms, host_ms, device_ratio, total_ratio in run(
                rows, dim, topology, args.repeats, args.runs, args.threads
            ):
                print(
                    f"{rows:>9} {dim:>4}  {step:<26}{fbgemm_ms:>8.2f}{device_ms:>9.2f}{host_ms:>11.2f}"
                    f"{device_ms + host_ms:>10.2f}{device_ratio:>10.2f}x{total_ratio:>9.2f}x"
                )
            print(f"{'':>15}load average {_load()}", flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
