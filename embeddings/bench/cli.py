"""`torchtpu-embedding-bench`: how fast are my tables on tpu, and against what I use today?

    torchtpu-embedding-bench --tables 8 --rows 100000 --dim 64 --batch-size 2048 \\
        --ids-per-bag 20 --id-distribution zipf:1.05 --optimizer rowwise_adagrad \\
        --sweep batch-size=512,1024,2048 --json out.json --csv out.csv --plot out.png

Options are checked before anything starts (exit 2 with what to change). The stand-in device
count is put into the environment before the tpu runtime starts; with `--processes N`, N stand-in
hosts are spawned (torch.multiprocessing), joined into one mesh over gloo. A system whose pooled
output differs from FBGEMM's ends the run with exit 3, before any timing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Sequence

from embeddings.bench.options import BenchOptionError, Invocation, parse

__all__ = ["main"]

PROG = "torchtpu-embedding-bench"
EXIT_BAD_OPTION = 2
EXIT_MISMATCH = 3
_FORCE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; the exit status (0, or `EXIT_BAD_OPTION` / `EXIT_MISMATCH`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        invocation = parse(argv)
    except BenchOptionError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_BAD_OPTION
    first = invocation.configs[0]
    _configure_stand_in(first.devices, first.processes)
    if first.processes == 1:
        return _run(invocation, rank=0, world=1)
    return _spawn(invocation, first.processes, first.devices)


def _configure_stand_in(devices: int, processes: int) -> None:
    """The stand-in device count, for the tpu runtime to read when it starts (it raises if it had
    already started with another count). On a TPU the runtime takes this many local chips."""
    os.environ["TORCHTPU_NUM_DEVICES"] = str(devices)
    flags = re.sub(_FORCE_COUNT_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FORCE_COUNT_FLAG}={devices}".strip()
    # Idle OpenMP workers would spin after each parallel region and steal the cores from the
    # system timed next; read when torch loads OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if processes > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))


def _run(invocation: Invocation, rank: int, world: int) -> int:
    """Every point of the invocation in this process; process 0 prints and writes the outputs."""
    from tqdm import tqdm

    from embeddings.bench import report
    from embeddings.bench.runner import SYSTEMS, OutputMismatchError, run_point

    steps = sum((c.warmup + c.iterations) * len(SYSTEMS) for c in invocation.configs)
    bar = tqdm(total=steps, desc=PROG, unit="step", file=sys.stderr,
               disable=rank != 0 or not invocation.progress or None, leave=False)
    points = []
    try:
        for config in invocation.configs:
            point = run_point(config, rank, world, bar.update)
            if point is not None:
                bar.clear()
                print(report.table(point) + "\n", flush=True)
                points.append(point)
    except OutputMismatchError as error:
        bar.close()
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_MISMATCH
    bar.close()
    if rank == 0:
        if invocation.json_path:
            report.write_json(invocation.json_path, points, invocation.sweep)
        if invocation.csv_path:
            report.write_csv(invocation.csv_path, points, invocation.sweep)
        if invocation.plot_path and invocation.sweep is not None:
            report.plot(invocation.plot_path, points, invocation.sweep)
    return 0


def _spawn(invocation: Invocation, processes: int, devices: int) -> int:
    """Run the invocation in `processes` spawned stand-in hosts; the first failure's exit status."""
    import torch.multiprocessing as mp

    lock_root = tempfile.mkdtemp(prefix="torchtpu-bench-locks-")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        mp.start_processes(_host, args=(invocation, processes, devices, port, lock_root), nprocs=processes,
                           join=True, start_method="spawn")
    except mp.ProcessExitedException as error:
        return error.exit_code if error.exit_code > 0 else 1
    finally:
        shutil.rmtree(lock_root, ignore_errors=True)
    return 0


def _host(rank: int, invocation: Invocation, world: int, devices: int, port: int, lock_root: str) -> None:
    """One spawned stand-in host: its environment, the process group and the mesh, then the run."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        TORCHTPU_LOCK_DIR=os.path.join(lock_root, str(rank)),
    )
    import torch.distributed as dist

    from embeddings import join_process_mesh

    dist.init_process_group("gloo")
    join_process_mesh()
    status = _run(invocation, rank, world)
    dist.destroy_process_group()
    if status:
        sys.exit(status)


if __name__ == "__main__":
    sys.exit(main())
