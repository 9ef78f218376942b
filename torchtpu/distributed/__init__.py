"""`tpu_dist`: the torch.distributed process-group backend for `tpu` tensors.

Importing torchtpu registers it, so `dist.init_process_group("tpu_dist")` and
`dist.init_process_group("cpu:gloo,tpu:tpu_dist")` work under torchrun or any other launcher.
One process drives one tpu device (`torch.tpu.set_device(local_rank)`).
"""

from __future__ import annotations

import torch.distributed as dist

from torchtpu.distributed.process_group import BACKEND_NAME, ProcessGroupTPU, create_process_group
from torchtpu.distributed.work import CollectiveError

if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["tpu"])

__all__ = ["BACKEND_NAME", "CollectiveError", "ProcessGroupTPU"]
