"""Time SparseCore host preprocessing against the embedding step it feeds.

Workload (the issue's): batch 2048, 8 tables, 20 ids per bag, Zipf(1.05) ids over 100k or 1M
rows (ranks hashed to ids by a fixed permutation, as real ids are), sum combiner, no weights.
Limits come from one warm-up pass with the default limits and dropping on (stats count the ids
before dropping), then `update_limits` with margin 1.2 -- as a training job sets them.

Prints median (and best) milliseconds per batch of `sparsecore.preprocess.preprocess` on two
stand-in topologies, one stack per table or auto-stacked, with and without the unique-row
side-car, on 1 or 2 threads, by its compiled and its NumPy implementation (`impl`), and its ratio
to baselines measured in the same run on the same ids
(dim 64): FBGEMM's CPU TBE forward + backward with EXACT_ROWWISE_ADAGRAD (TorchRec's fused CPU
path) and torch.nn.EmbeddingBag forward + backward + sparse SGD. The load average is printed
because other processes on a 2-core machine move every number.

    .venv/bin/python -m benchmarks.sparsecore_preprocess [--repeats 30] [--rows 100000 1000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from embeddings.bench.workload import zipf_ids
from sparsecore.layout import auto_stack_tables, stack_tables
from sparsecore.preprocess import RaggedIds, preprocess, update_limits
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

BATCH = 2048
TABLES = 8
IDS_PER_BAG = 20
DIM = 64


def workload(rows: int, seed: int = 0) -> tuple[list[FeatureSpec], dict[str, RaggedIds]]:
    rng = np.random.default_rng(seed)
    features, inputs = [], {}
    for t in range(TABLES):
        table = TableSpec(f"table_{t}", rows, DIM)  # default limits; the warm-up pass sets them
        features.append(FeatureSpec(f"feature_{t}", table, BATCH))
        values = zipf_ids(rng, rows, BATCH * IDS_PER_BAG)
        inputs[f"feature_{t}"] = RaggedIds(values, lengths=np.full(BATCH, IDS_PER_BAG))
    return features, inputs


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, best) milliseconds of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def baselines(rows: int, inputs: dict[str, RaggedIds], repeats: int) -> dict[str, float]:
    """Median ms of one embedding training step on the same ids with FBGEMM and torch."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        ComputeDevice,
        EmbeddingLocation,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    torch.manual_seed(0)
    values = torch.from_numpy(np.concatenate([ids.values for ids in inputs.values()]))
    offsets = torch.arange(0, len(values) + 1, IDS_PER_BAG)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)] * TABLES,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
    )

    def fbgemm_step() -> None:
        tbe(values, offsets).sum().backward()

    bags = [torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True) for _ in range(TABLES)]
    optimizer = torch.optim.SGD([p for bag in bags for p in bag.parameters()], lr=0.01)
    per_table = [torch.from_numpy(ids.values) for ids in inputs.values()]
    bag_offsets = torch.arange(0, BATCH * IDS_PER_BAG, IDS_PER_BAG)

    def torch_step() -> None:
        optimizer.zero_grad()
        sum(bag(v, bag_offsets).sum() for bag, v in zip(bags, per_table)).backward()
        optimizer.step()

    return {
        "FBGEMM TBE fwd+bwd rowwise-Adagrad": timed(fbgemm_step, repeats)[0],
        "torch EmbeddingBag fwd+bwd+SGD": timed(torch_step, repeats)[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    for rows in args.rows:
        features, inputs = workload(rows)
        base = baselines(rows, inputs, args.repeats)
        print(f"\n{TABLES} tables x {rows} rows, batch {BATCH}, {IDS_PER_BAG} ids/bag, Zipf")
        for name, ms in base.items():
            print(f"  baseline {name}: {ms:.1f} ms")
        names = list(base)
        print(
            f"  {'topology':<20}{'stacks':>7}{'unique':>7}{'thr':>4}{'impl':>8}{'median':>9}{'best':>7}"
            f"{'/FBGEMM':>9}{'/torch':>8}"
        )
        for devices in (1, 8):
            topology = Topology.cpu(devices, 4)
            for stacker in (stack_tables, auto_stack_tables):
                stacks = stacker(features, topology)
                warm = preprocess(stacks, inputs, topology, allow_id_dropping=True)
                stacks = tuple(update_limits(s, warm[s.name].stats, margin=1.2) for s in stacks)
                for unique in (True, False):
                    for threads in (1, 2):
                        for implementation in ("native", "numpy"):
                            median, best = timed(
                                lambda: preprocess(
                                    stacks,
                                    inputs,
                                    topology,
                                    with_unique_rows=unique,
                                    num_threads=threads,
                                    implementation=implementation,
                                ),
                                args.repeats,
                            )
                            print(
                                f"  {f'{devices} dev x 4 SC':<20}{len(stacks):>7}{str(unique):>7}"
                                f"{threads:>4}{implementation:>8}{median:>9.2f}{best:>7.2f}"
                                f"{median / base[names[0]]:>9.2f}{median / base[names[1]]:>8.2f}"
                            )
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
