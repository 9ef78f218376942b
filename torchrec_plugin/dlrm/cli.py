"""`torchtpu-train-dlrm`: train TorchRec's DLRM-DCN (MLPerf DLRM-v2 structure) on `tpu`.

    torchtpu-train-dlrm                                   # the `small` preset, synthetic data
    torchtpu-train-dlrm --size tiny --steps 300 --mode compiled
    torchtpu-train-dlrm --nproc 2                         # two processes, each a stand-in host
    torchrun --nproc-per-node 2 -m torchrec_plugin.dlrm.cli
    torchtpu-train-dlrm --checkpoint-dir /tmp/dlrm --checkpoint-every 100 [--resume]
    torchtpu-train-dlrm --data-dir /data/criteo           # TorchRec's Criteo TSV or NPY files

The tables are sharded by TorchRec's planner with the plugin's TPU topology and sharders, under
`DistributedModelParallel`; each process drives one tpu device. Prints a progress bar (loss,
examples/s), the held-out AUC and log-loss every `--eval-every` steps, and a summary: throughput
and the share of time spent waiting for input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torchrec_plugin.dlrm import launch
from torchrec_plugin.dlrm.config import PRESETS, preset

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchtpu-train-dlrm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(PRESETS), default="small", help="model and batch preset")
    parser.add_argument("--steps", type=int, help="last training step (default: the preset's)")
    parser.add_argument("--batch-size", type=int, help="samples per process and step (default: the preset's)")
    parser.add_argument("--mode", choices=["strict", "defer", "compiled"], default="defer")
    parser.add_argument("--table-optimizer", choices=["adagrad", "rowwise_adagrad"], default="adagrad",
                        help="the tables' fused optimizer")
    parser.add_argument("--precision", choices=["default", "high", "highest"], default="default",
                        help="tpu matmul precision (default: bf16 products, as a TPU computes them)")
    parser.add_argument("--autocast", action="store_true",
                        help="forward passes under torch.autocast('tpu'): bfloat16 activations, float32 loss")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes to spawn on this machine (each drives one tpu device)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="steps between held-out evaluations (0: a fifth of the run)")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="steps between checkpoints (0: at the end only)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    parser.add_argument("--data-dir", type=Path,
                        help="Criteo data (TorchRec's TSV or NPY files) instead of the synthetic stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "nproc", "eval_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.nproc > 1 and not launch.launched_by_torchrun():
        launch.spawn(_job, args.nproc, args)
    else:
        launch.run(_job, args)


def _job(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from torchrec_plugin.dlrm.model import build
    from torchrec_plugin.dlrm.train import TrainOptions, train

    config = preset(args.size).with_table_optimizer(args.table_optimizer)
    if args.batch_size is not None:
        config = config.with_batch_size(args.batch_size)
    steps = args.steps or config.default_steps
    rank, world = dist.get_rank(), dist.get_world_size()
    options = TrainOptions(
        steps=steps,
        mode=args.mode,
        eval_every=args.eval_every or max(1, steps // 5),
        eval_batches=args.eval_batches,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        precision=args.precision,
        autocast=args.autocast,
        progress=args.progress,
    )
    training = build(config, seed=args.seed)
    summary = train(training, _source(args, config, rank, world), options)
    if rank == 0:
        print(summary.report(), flush=True)


def _source(args: argparse.Namespace, config, rank: int, world: int):
    if args.data_dir is None:
        from torchrec_plugin.dlrm.synthetic import SyntheticCriteo

        return SyntheticCriteo(config, seed=args.seed, rank=rank)
    from torchrec_plugin.dlrm.criteo import CriteoData

    return CriteoData(args.data_dir, config, rank=rank, world_size=world)


if __name__ == "__main__":
    main()
