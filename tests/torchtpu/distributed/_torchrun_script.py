"""Run under torchrun by `test_torchrun.py`: tpu_dist from torchrun's environment variables.

The default group is tpu-only ("tpu_dist"); a second group mixes gloo for cpu tensors with
tpu_dist for tpu tensors ("cpu:gloo,tpu:tpu_dist").
"""

import os

import torch
import torch.distributed as dist

import torchtpu  # noqa: F401  (registers tpu_dist)

local_rank = int(os.environ["LOCAL_RANK"])
torch.tpu.set_device(local_rank)
dist.init_process_group("tpu_dist")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("tpu", local_rank)
expected = [world * (world + 1) / 2] * 4

x = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(x)
assert x.cpu().tolist() == expected, x

mixed = dist.new_group(backend="cpu:gloo,tpu:tpu_dist")
assert dist.get_backend_config(mixed) == "cpu:gloo,tpu:tpu_dist", dist.get_backend_config(mixed)
y = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(y, group=mixed)
on_cpu = torch.full((4,), float(rank + 1))
dist.all_reduce(on_cpu, group=mixed)
assert y.cpu().tolist() == on_cpu.tolist() == expected, (y, on_cpu)
try:
    dist.all_reduce(torch.ones(2))
except RuntimeError as error:
    assert "serves tpu tensors only" in str(error), error
else:
    raise AssertionError("a cpu tensor on the tpu-only default group was accepted")

dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} of {world}: ok")
