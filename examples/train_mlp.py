"""A small model trained on `tpu`: the same code as on CPU or CUDA, with device="tpu".

    python -m examples.train_mlp [--steps N] [--mode strict|debug|defer|compiled]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import torchtpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mode", choices=["strict", "debug", "defer", "compiled"], default="defer")
    args = parser.parse_args()

    torch.manual_seed(0)
    # A synthetic regression task with a known answer, so the loss must fall.
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to("tpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    forward = torch.compile(model, backend="tpu") if args.mode == "compiled" else model
    torchtpu.set_eager_mode("strict" if args.mode == "compiled" else args.mode)

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, 16)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(forward(x.to("tpu")), y.to("tpu"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.5f}")
    torch.tpu.synchronize()
    elapsed = time.perf_counter() - start
    print(f"{args.steps} steps in {elapsed:.1f} s ({args.mode} mode); metrics: "
          f"{ {k: v for k, v in torchtpu.metrics().items() if not isinstance(v, dict)} }")


if __name__ == "__main__":
    main()
