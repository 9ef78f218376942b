"""Several processes, one mesh: joining the multi-process runtime, and each process's rows.

With one process per device (or per host), the SparseCore tables span the devices of every
process: `join_process_mesh` starts JAX's multi-controller runtime from the torch.distributed job
(before the tpu device is first used), after which `torchtpu.sharding.mesh()` covers every
process's devices and the lookup and update programs run across processes with XLA collectives
(over gloo on the CPU stand-in).

The programs work on global arrays; the rest of a process's model works on its own samples. The
lookup's activations are therefore handed to the model as `process_rows`: this process's rows
of the global activations, on its first tpu device (no copy when the process drives one device).
Their gradient goes back into the global array the update reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchtpu import runtime, sharding, storage
from torchtpu.exec import memory

__all__ = ["join_process_mesh", "process_rows"]


def join_process_mesh(store: dist.Store | None = None) -> None:
    """Join this process to a mesh of every process's tpu devices (JAX multi-controller).

    Call after `torch.distributed.init_process_group` and before anything uses the tpu device;
    the coordinator address goes through `store` (default: the default group's). Not needed when
    the default group is `tpu_dist` with the XLA transport (on TPU), which joins it itself; a
    no-op for a single process.
    """
    if not dist.is_initialized():
        raise RuntimeError("join_process_mesh: call torch.distributed.init_process_group first")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    runtime.configure_distributed_from_store(store, rank, world, key="torchtpu/sparsecore_coordinator")


def process_rows(tensor: torch.Tensor) -> torch.Tensor:
    """This process's rows of a tensor sharded over the mesh (differentiable). With one process
    the mesh is all local and the tensor is returned as it is."""
    if runtime.runtime().process_count == 1:
        return tensor
    return _process_rows(tensor)


@torch._dynamo.disable
def _process_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Host-side JAX work on global arrays: a graph break under `torch.compile`."""
    return _ProcessRows.apply(tensor)


class _ProcessRows(torch.autograd.Function):
    """Global rows (sharded over every process's devices) <-> this process's rows on `tpu:0`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        import jax
        import jax.numpy as jnp

        ctx.global_shape = tuple(tensor.shape)
        value = sharding.to_jax(tensor)
        home = runtime.jax_device(0)
        blocks = [shard.data for shard in sorted(value.addressable_shards, key=lambda s: s.index[0].start or 0)]
        local = blocks[0] if len(blocks) == 1 and blocks[0].devices() == {home} else jnp.concatenate(
            [jax.device_put(block, home) for block in blocks]
        )
        flat = local.reshape(-1)
        buffer = storage.DeviceBuffer(tensor.dtype, flat.shape[0], 0, flat)
        return storage.new_tensor(buffer, tuple(local.shape))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import jax

        local = memory.to_array(grad.contiguous()).reshape(tuple(grad.shape))
        value = jax.make_array_from_process_local_data(sharding.flat_sharding(), local, ctx.global_shape)
        return sharding.from_jax(value)
