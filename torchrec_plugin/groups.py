"""The gloo group beside a `tpu_dist` group: for what torch.distributed runs on the host.

Two things the plugin's users reach expect a group that is plain gloo:

* `torch.distributed.checkpoint` plans over `gather_object` / `scatter_object_list`, which call
  `gather` / `scatter` on cpu tensors; `tpu_dist` groups do not serve those.
* PyTorch answers `.device` of a ShardedTensor that has no shard on this rank with its group:
  "cpu" for a gloo group, the current CUDA device for any other (which fails without CUDA). DCP's
  load asks it of every ShardedTensor of a state dict, and a sharded module holds one per table,
  with or without a local shard.

`host_group(group)` returns a gloo group over `group`'s ranks: `group` itself if it is gloo, else
one already registered with torch.distributed, else a new one. Every rank of the default group
must call it together (a new group is created collectively), in the same order.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["host_group"]


def host_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A gloo group over the ranks of `group` (default: the default group)."""
    group = group if group is not None else dist.group.WORLD
    if dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group)
    for candidate in list(distributed_c10d._world.pg_map):
        if dist.get_backend(candidate) == "gloo" and dist.get_process_group_ranks(candidate) == ranks:
            return candidate
    return dist.new_group(ranks, backend="gloo")
