"""Bus bandwidth of tpu_dist collectives on `tpu` tensors next to gloo on CPU tensors.

    python benchmarks/collectives.py [--world-size 2] [--sizes-mib 1 16 64] [--iters N] [--trials 7]
                                     [--seconds 3.0] [--launches 3] [--tensors tpu|cpu]

Spawns one process per rank (as torchrun would; on the CPU stand-in each rank drives tpu:<rank>).
Both sides run the same collective on the same number of bytes in the same processes: gloo on CPU
tensors (a plain `dist.new_group(backend="gloo")`) and tpu_dist on tpu tensors. After a warm-up of
both, each trial times one block of `iters` calls of each side back to back, the side that goes
first alternating between trials, so that the shared machine's load falls on both alike; every block
starts and ends with the same gloo barrier. A block has at least 10 calls and moves at least 32 MiB
(`--iters` sets its calls instead): on a shared 2-core host single calls stall for a scheduler tick
now and then (~4-6 ms, against ~0.6 ms for a 1 MiB all-to-all), and one such stall could decide a
block of ten 1 MiB calls. Each size runs at least `--trials` trials, and more where blocks are
short, so that each side's timed blocks last about `--seconds` in all (estimated from one untimed
gloo block; the ranks agree on the largest count): a 1 MiB block lasts ~20-30 ms against ~0.3-0.6 s
at 64 MiB. About a tenth of the calls stall (~3 ms, gloo's as often as tpu_dist's), so the ratio
within a trial spreads by ~+-20%; a few seconds of blocks (up to 200 trials) pin down the median
of a launch.

The whole measurement runs `--launches` times, in fresh processes each time, and the ratio
reported is the median over launches. Within a launch, each gloo device's transport thread keeps
the place the scheduler gave it, and that decides more than most changes to the code: on two
cores, the same bare exchange on two gloo devices of the same structure differed by ~100 us of
transport-thread CPU per 1 MiB call, ~250 us of wall time, and which device was the faster one
changed from launch to launch (`docs/tpu_dist-performance.md`). So one launch's ratio at 1 MiB
moved by ~+-0.1 between launches of the same code, however many trials it ran, while its trials
agreed with each other; more launches, not longer ones, pin the ratio down.

Reported: per row, each side's bus bandwidth (the median block of a launch, median over launches),
the ratio tpu_dist / gloo (a launch's median over trials of the ratio within a trial, median over
launches), and every launch's ratio with the quartiles of its trials' ratios. Bus bandwidth
follows nccl-tests: all_reduce moves 2(n-1)/n of the buffer per rank, all_to_all (n-1)/n. The
all-to-alls run twice: into the same output every call, and into a new output each call, as
TorchRec's do every step. The goal is tpu_dist >= 0.9x gloo: the backend itself should add next to
nothing to the transport it runs on. (One thing it adds on purpose: before an all-to-all every
rank's sizes are agreed -- a small point-to-point message to each peer, skipped while sizes repeat
-- so that mismatched splits raise instead of hanging; gloo checks nothing.) `--tensors cpu` gives
tpu_dist CPU tensors (its group serves both): its transport alone, without reading and claiming
device buffers, which tells the two costs apart. Its all_reduce is gloo's own, so that row's ratio
shows how far noise alone moves a ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import tempfile
import time

import torch.multiprocessing as mp

def _all_to_all_into_new(output, input, group) -> None:
    """all_to_all_single into a new tensor like `output`, as TorchRec's all-to-alls write each
    step (both sides pay for making it: ~1 us alone for a cpu tensor, ~7 for a tpu one)."""
    import torch
    import torch.distributed as dist

    dist.all_to_all_single(torch.empty_like(output), input, group=group)


def _collectives():
    """What each row times: its name, its bus bandwidth per byte of the buffer (nccl-tests: an
    all_reduce moves 2(n-1)/n of it per rank, an all-to-all (n-1)/n), the collective, and its
    CPU tensors of n elements."""
    import torch
    import torch.distributed as dist

    all_reduce, all_to_all = (lambda n: 2 * (n - 1) / n), (lambda n: (n - 1) / n)
    return (
        ("all_reduce", all_reduce, dist.all_reduce, lambda n: [torch.ones(n)]),
        ("all_to_all_single", all_to_all, dist.all_to_all_single, lambda n: [torch.empty(n), torch.ones(n)]),
        ("all_to_all (new out)", all_to_all, _all_to_all_into_new, lambda n: [torch.empty(n), torch.ones(n)]),
    )


def _time_block(collective, tensors, group, barrier_group, iters: int) -> float:
    import torch.distributed as dist

    dist.barrier(group=barrier_group)
    start = time.perf_counter()
    for _ in range(iters):
        collective(*tensors, group=group)
    dist.barrier(group=barrier_group)
    return (time.perf_counter() - start) / iters


def _block_calls(mib: int, iters: int | None) -> int:
    """Calls per timed block: `iters`, else at least 10 moving at least 32 MiB."""
    return iters if iters is not None else max(10, -(-32 // mib))


_MAX_TRIALS = 200


def _trial_count(block_seconds: float, trials: int, seconds: float, group) -> int:
    """Trials at one size: at least `trials`, and enough blocks of `block_seconds` to last
    `seconds`; the largest count of any rank, so that every rank runs as many."""
    import torch
    import torch.distributed as dist

    count = torch.tensor([max(trials, math.ceil(seconds / max(block_seconds, 1e-6)))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return min(int(count), _MAX_TRIALS)


def _rank(rank: int, world: int, port: int, lock_dir: str, sizes_mib: list[int], iters: int | None,
          trials: int, seconds: float, tensor_kind: str, result: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), TORCHTPU_LOCK_DIR=lock_dir, TORCHTPU_NUM_DEVICES=str(world),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={world}",
    )
    import torch
    import torch.distributed as dist

    import torchtpu  # noqa: F401  (registers tpu_dist)

    torch.tpu.set_device(rank)
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    gloo = dist.new_group(backend="gloo")
    device = torch.device("tpu", rank)
    load_before = os.getloadavg()
    rows = []
    for name, bus_factor, collective, make in _collectives():
        for mib in sizes_mib:
            numel = mib * 2**20 // 4 // world * world
            cpu = make(numel)
            tpu = [t.to(device) if tensor_kind == "tpu" else t.clone() for t in cpu]
            sides = {"gloo": (cpu, gloo), "tpu_dist": (tpu, dist.group.WORLD)}
            for tensors, group in sides.values():
                _time_block(collective, tensors, group, gloo, 3)  # warm-up: connections, buffers, programs
            block_calls = _block_calls(mib, iters)
            block = _time_block(collective, cpu, gloo, gloo, block_calls) * block_calls
            count = _trial_count(block, trials, seconds, gloo)
            times: dict[str, list[float]] = {"gloo": [], "tpu_dist": []}
            for trial in range(count):
                order = ("gloo", "tpu_dist") if trial % 2 == 0 else ("tpu_dist", "gloo")
                for side in order:
                    tensors, group = sides[side]
                    times[side].append(_time_block(collective, tensors, group, gloo, block_calls))
            bus = bus_factor(world) * numel * 4 / 1e9
            ratios = [g / t for g, t in zip(times["gloo"], times["tpu_dist"])]
            ratio = statistics.median(ratios)
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            rows.append((name, mib, count, bus / statistics.median(times["gloo"]),
                         bus / statistics.median(times["tpu_dist"]), ratio, q1, q3))
    if rank == 0:
        keys = ("name", "mib", "trials", "gloo_bw", "tpu_bw", "ratio", "q1", "q3")
        with open(result, "w") as f:
            json.dump({"load": [load_before[0], os.getloadavg()[0]], "rows": [dict(zip(keys, row)) for row in rows]}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=None, help="calls per timed block (default: >= 10, >= 32 MiB)")
    parser.add_argument("--trials", type=int, default=7, help="trials per size, at least")
    parser.add_argument("--tensors", choices=("tpu", "cpu"), default="tpu",
                        help="what tpu_dist moves: tpu tensors, or cpu tensors (its transport alone)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="timed blocks per side and size, about (more trials where blocks are short)")
    parser.add_argument("--launches", type=int, default=3,
                        help="launches of fresh processes, each timing every row (the ratio is their median)")
    args = parser.parse_args()
    if args.launches < 1:
        parser.error("--launches must be at least 1")
    launches = [_launch(args) for _ in range(args.launches)]
    _report(launches, args)


def _launch(args: argparse.Namespace) -> dict:
    """One launch of `args.world_size` fresh processes: rank 0's rows and load averages."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="tpu-dist-bench-") as lock_dir:
        result = os.path.join(lock_dir, "rows.json")
        mp.start_processes(
            _rank,
            args=(args.world_size, port, lock_dir, args.sizes_mib, args.iters, args.trials, args.seconds,
                  args.tensors, result),
            nprocs=args.world_size,
            start_method="spawn",
        )
        with open(result) as f:
            return json.load(f)


def _report(launches: list[dict], args: argparse.Namespace) -> None:
    """One line per row: bus bandwidths and ratio as the median over launches, then each
    launch's ratio with the quartiles of its trials' ratios."""
    if args.tensors == "cpu":
        print("tpu_dist on cpu tensors: its transport alone, without the device's buffers")
    calls = ", ".join(f"{_block_calls(mib, args.iters)} at {mib} MiB" for mib in args.sizes_mib)
    print(f"world size {args.world_size}; {len(launches)} launches of fresh processes; in each, trials of a block "
          f"of calls per side ({calls}), at least {args.trials} and ~{args.seconds:g} s of blocks per side")
    print("bus bandwidth in GB/s (median block of a launch, median over launches); ratio = median over launches "
          "of a launch's median over trials of tpu_dist / gloo; per launch: that ratio (quartiles of its trials)")
    loads = "; ".join(f"{launch['load'][0]:.2f} -> {launch['load'][1]:.2f}" for launch in launches)
    print(f"load average (1 min) before -> after each launch: {loads}")
    print(f"{'collective':<20} {'MiB':>4} {'gloo cpu':>9} {'tpu_dist':>9} {'ratio':>6}  per launch")
    for i, (name, mib) in enumerate((row["name"], row["mib"]) for row in launches[0]["rows"]):
        rows = [launch["rows"][i] for launch in launches]
        gloo_bw = statistics.median(row["gloo_bw"] for row in rows)
        tpu_bw = statistics.median(row["tpu_bw"] for row in rows)
        ratio = statistics.median(row["ratio"] for row in rows)
        each = "  ".join(f"{row['ratio']:.2f} ({row['q1']:.2f}-{row['q3']:.2f})" for row in rows)
        print(f"{name:<20} {mib:>4} {gloo_bw:>9.3f} {tpu_bw:>9.3f} {ratio:>6.2f}  {each}")


if __name__ == "__main__":
    main()
