"""Examples/s of the DLRM-DCN training job on `tpu` in each mode, against plain TorchRec on CPU.

Same model (a `torchrec_plugin.dlrm.config` preset, `mlperf` by default), same batches (a few
synthetic batches made once and cycled, so data generation is not timed), same batch size and
process count. The baseline is what a user would otherwise run on this machine: TorchRec's
`DistributedModelParallel` on CPU over gloo with FBGEMM's fused Adagrad kernels for the tables
(table-wise, planned by TorchRec's own planner) and `torch.optim.Adagrad` for the dense layers.

Both sides take the objects alive after their warm-up out of the garbage collector's reach
(`gc.freeze`), as the training job does, so that no full collection lands in either's timed steps.
Each measurement runs in a fresh process; the script prints examples/s per configuration and
the ratio to TorchRec's. A script, not a test: nothing asserts.

It also prints the machine's compute ceiling for the model: the matmul FLOPs of one step
(forward and backward, counted by `torch.utils.flop_counter` on the CPU model) over the matmul
rate this machine reaches (one large matmul): in fp32, as TorchRec computes, and with bf16
products accumulated in fp32, as the tpu modes' `default` precision computes them on this host
(`torchtpu.precision.dot_general` itself: fp32 inputs rounded to bf16, then XLA:CPU's bf16 dot,
or widened to fp32 where the CPU has no bf16 instructions). The
examples/s that gives is what a step made of nothing but those matmuls, at that rate, would
reach.

    python benchmarks/dlrm_throughput.py [--size mlperf] [--steps 100] [--modes strict defer compiled]

100 timed steps by default (7-10 s a side on the development machine): with 30, the ratio to
TorchRec moved by up to 0.3 between consecutive runs (1.05-1.37x); with 100, by under 0.1 (four
runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CYCLED_BATCHES = 4
WARMUP_STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="mlperf")
    parser.add_argument("--steps", type=int, default=100, help="timed steps (after a warm-up)")
    parser.add_argument("--modes", nargs="+", default=["strict", "defer", "compiled"])
    parser.add_argument("--table-optimizer", choices=["adagrad", "rowwise_adagrad"], default="rowwise_adagrad",
                        help="the tables' fused optimizer on both sides (FBGEMM's CPU Adagrad is a slow generic path)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(_measure(args.one, args.size, args.steps, args.table_optimizer)), flush=True)
        return
    print(f"DLRM-DCN '{args.size}', tables with {args.table_optimizer}, 1 process, {args.steps} timed steps; "
          f"load average {os.getloadavg()[0]:.1f}")
    baseline = _in_subprocess("torchrec", args)["examples_per_second"]
    print(f"  TorchRec DMP on CPU (FBGEMM, gloo): {baseline:10,.0f} examples/s")
    ceiling = _in_subprocess("ceiling", args)
    print(f"  compute ceiling: {ceiling['gflop_per_step']:.1f} GFLOP of matmuls a step; at this machine's matmul "
          "rate that is at most")
    for name, label in (("fp32", "fp32 (TorchRec's math)"), ("bf16", "bf16 products (tpu default precision)")):
        rate = ceiling[name]
        print(f"    {label:40s} {rate['gflops']:6.0f} GFLOP/s: {rate['examples_per_second']:10,.0f} examples/s "
              f"({rate['examples_per_second'] / baseline:.2f}x TorchRec)")
    for mode in args.modes:
        rate = _in_subprocess(f"tpu:{mode}", args)["examples_per_second"]
        print(f"  tpu, {mode:8s}: {rate:10,.0f} examples/s  ({rate / baseline:.2f}x TorchRec)")


def _in_subprocess(what: str, args: argparse.Namespace) -> dict:
    # As a module from the checkout: benchmarks/sparsecore.py would shadow the sparsecore package.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHTPU_NUM_DEVICES": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    command = [sys.executable, "-m", "benchmarks.dlrm_throughput", "--one", what, "--size", args.size,
               "--steps", str(args.steps), "--table-optimizer", args.table_optimizer]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(results[-1][len("RESULT "):])


def _measure(what: str, size: str, steps: int, table_optimizer: str) -> dict:
    from torchrec_plugin.dlrm.config import preset
    from torchrec_plugin.dlrm.synthetic import SyntheticCriteo

    config = preset(size).with_table_optimizer(table_optimizer)
    stream = SyntheticCriteo(config, seed=0)
    batches = [stream.train_batch(step) for step in range(CYCLED_BATCHES)]
    if what == "torchrec":
        return _torchrec(config, batches, steps)
    if what == "ceiling":
        return _ceiling(config, batches[0])
    _, mode = what.split(":")
    return _tpu(config, batches, steps, mode)


class _Cycled:
    """A batch source over a few pre-made batches."""

    def __init__(self, batches: list) -> None:
        self._batches = batches

    def train_batch(self, step: int):
        return self._batches[step % len(self._batches)]

    def held_out_batch(self, index: int):
        return self._batches[index % len(self._batches)]


def _tpu(config, batches: list, steps: int, mode: str) -> dict:
    from torchrec_plugin.dlrm import launch
    from torchrec_plugin.dlrm.model import build
    from torchrec_plugin.dlrm.train import TrainOptions, train

    def job() -> dict:
        training = build(config)
        options = TrainOptions(steps=steps + 3, mode=mode, eval_batches=1, progress=False, log_every=steps + 3)
        summary = train(training, _Cycled(batches), options)
        return {"examples_per_second": summary.examples_per_second, "input_wait": summary.input_wait_share}

    return launch.run(job)


def _torchrec(config, batches: list, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_plugin.dlrm.model import (
        apply_table_optimizer,
        dense_optimizer,
        dense_parameters,
        dlrm_dcn,
        embedding_bag_configs,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(config), device=torch.device("meta"))
    model = dlrm_dcn(config, ebc, torch.device("meta"), seed=0)
    apply_table_optimizer(config, model.sparse_arch)
    # Table-wise, fused (FBGEMM TBE): TorchRec's best plan here. Its default plan makes small
    # tables data-parallel, whose full-table gradients cost more than the rest of the step.
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
                   for t in embedding_bag_configs(config)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints,
                                       batch_size=config.batch_size)
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   env=ShardingEnv.from_process_group(dist.group.WORLD))
    optimizer = dense_optimizer(config, dense_parameters(dmp).values())

    def step(batch) -> None:
        logits = dmp(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for i in range(WARMUP_STEPS):
        step(batches[i % len(batches)])
    gc.collect()
    gc.freeze()  # as the training job does after its warm-up
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"examples_per_second": steps * config.batch_size / seconds}


def _ceiling(config, batch) -> dict:
    """Matmul FLOPs of a training step (the CPU model's forward and backward) and the matmul rates
    of this machine -- fp32 (torch) and bf16 products with fp32 accumulation (XLA:CPU) -- and the
    examples/s they allow."""
    import jax
    import jax.numpy as jnp
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from torchrec_plugin.dlrm.model import reference
    from torchtpu import precision

    model, _ = reference(config)
    with FlopCounterMode(display=False) as counter:
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float()).backward()
    flops = counter.get_total_flops()
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    # A `default`-precision product as the tpu modes compute it on this host (the one pass of
    # torchtpu.precision: XLA:CPU's bf16 dot, or widened to fp32 without bf16 instructions).
    bf16_dot = jax.jit(lambda x, y: precision.dot_general(x, y, (((1,), (0,)), ((), ())), "default", "cpu"))
    x, y = (jnp.asarray(t.numpy()) for t in (a, b))
    runs = {"fp32": lambda: a @ b, "bf16": lambda: bf16_dot(x, y).block_until_ready()}
    result: dict = {"gflop_per_step": flops / 1e9}
    for name, run in runs.items():
        run()
        start = time.perf_counter()
        for _ in range(10):
            run()
        rate = 10 * 2 * n**3 / (time.perf_counter() - start)
        result[name] = {"gflops": rate / 1e9, "examples_per_second": config.batch_size * rate / flops}
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    main()
