"""Sharded `tpu` tensors: one logical tensor whose rows are spread over the devices of a mesh.

A sharded tensor is an ordinary `tpu` tensor to PyTorch (its device is the mesh's first device,
`tpu:0`), whose storage's buffer is a global `jax.Array` laid out in equal contiguous blocks, one
per device of the mesh (`NamedSharding(mesh, P(AXIS))` over the flat buffer, which for a
`[rows, ...]` tensor with `rows` divisible by the mesh size is sharding by rows). Every op works
on it: the executor compiles ops on sharded buffers with XLA's SPMD partitioner, which keeps the
data where it is and inserts the collectives an op needs. The SparseCore embedding tables are
such tensors: each device holds its SparseCores' shards, and the lookup kernels run over the
same mesh.

The mesh covers this process's tpu devices; in a multi-process job (see
`torchtpu.runtime.configure_distributed`) it covers the tpu devices of every process, in
process order, and each process holds only its own blocks.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from torchtpu import dtypes, out_of_memory, runtime, storage

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

AXIS = "tpu"
"""The mesh axis name: the devices of the mesh, in order."""


@functools.lru_cache(maxsize=None)
def _mesh(devices: tuple) -> "Mesh":
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices, dtype=object), (AXIS,))


def mesh_devices() -> tuple["jax.Device", ...]:
    """The devices of the mesh: every process's tpu devices, in process order."""
    rt = runtime.runtime()
    if rt.process_count == 1:
        return rt.devices
    import jax

    per_process: dict[int, list] = {}
    for device in sorted(jax.devices(rt.platform), key=lambda d: (d.process_index, d.id)):
        per_process.setdefault(device.process_index, []).append(device)
    count = len(rt.devices)
    return tuple(d for p in sorted(per_process) for d in per_process[p][:count])


def mesh() -> "Mesh":
    """The 1-D mesh (axis `AXIS`) of sharded tensors and of the SparseCore kernels."""
    for index in range(len(runtime.runtime().devices)):
        runtime.jax_device(index)  # the mesh uses every device of this process: take their locks
    return _mesh(mesh_devices())


def flat_sharding():
    """The sharding of a sharded tensor's flat buffer: equal contiguous blocks over the mesh."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh(), P(AXIS))


def is_sharded(value) -> bool:
    """True for a buffer value spread over several devices."""
    sharding = getattr(value, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def replicated(value: "jax.Array") -> "jax.Array":
    """A single-device value copied to every device of the mesh, to meet sharded operands."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    with out_of_memory.raised_as_torch():
        return jax.device_put(value, NamedSharding(mesh(), P()))


def _flat(array: "jax.Array") -> "jax.Array":
    """`array` as the flat buffer of a sharded tensor (`flat_sharding`): each device reshapes its
    own block of rows -- programs of one device each, never one spanning the mesh. The
    prefetching loader makes sharded tensors on its own thread while the step launches mesh-wide
    programs on another, and two threads launching mesh-wide programs at once deadlocked XLA:CPU
    whatever its thread pool (measured; its source suggests the second program's per-device
    launches can take a device's last slots for programs in flight before the first program's,
    which then waits for a slot held by programs queued behind it). An array whose rows are not
    split over the mesh so (on one device, replicated) first moves them there (`jax.device_put`:
    copies between devices). All of the mesh's devices must be this process's."""
    import jax

    target = flat_sharding()  # rows of the flat buffer over the mesh: P(AXIS) for any rank
    if not array.sharding.is_equivalent_to(target, array.ndim):
        with out_of_memory.raised_as_torch():
            array = jax.device_put(array, target)
    blocks = [shard.data.reshape(-1) for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays((array.size,), target, blocks)


def _check_rows(shape: tuple[int, ...], what: str) -> None:
    devices = len(mesh_devices())
    if not shape or shape[0] % devices:
        raise ValueError(
            f"{what}: a sharded tensor is split by rows over the {devices} mesh devices, so its "
            f"first dimension must be a multiple of {devices}; got shape {list(shape)}"
        )


def from_jax(array: "jax.Array") -> torch.Tensor:
    """A sharded `tpu` tensor that takes ownership of `array`, whose rows are split over `mesh()`
    (or are moved there first: an array on one device, or replicated).

    `array` must not be used after the call: in-place ops donate the tensor's buffer."""
    _check_rows(tuple(array.shape), "from_jax")
    return _wrap(_flat(array), dtypes.from_jax(array.dtype), tuple(array.shape))


def from_process_local(local: np.ndarray) -> torch.Tensor:
    """A sharded `tpu` tensor from this process's rows of it (`[local devices * r, ...]`, its
    devices' blocks in mesh order; every process passes its own): each block moves to its
    device as the flat buffer it becomes, with no device program. (`from_jax` of the same rows
    put as `[devices, ...]` arrays reshapes each device's block with a program of its own.)"""
    _, count = _local_positions()
    if not local.shape or local.shape[0] % count:
        raise ValueError(
            f"from_process_local: this process's rows are split over its {count} devices, so "
            f"their first dimension must be a multiple of {count}; got shape {list(local.shape)}"
        )
    shape = (local.shape[0] * (len(mesh_devices()) // count), *local.shape[1:])
    return _wrap(_flat_from_local(local, shape), dtypes.from_jax(local.dtype), shape)


def _local_positions() -> tuple[int, int]:
    """Where this process's devices sit in the mesh: the first position and how many (a
    process's devices are consecutive, `mesh_devices`)."""
    import jax

    mine = [i for i, d in enumerate(mesh_devices()) if d.process_index == jax.process_index()]
    return mine[0], len(mine)


def _flat_from_local(local: np.ndarray, shape: tuple[int, ...]) -> "jax.Array":
    """The flat buffer of a sharded tensor of global `shape` from this process's rows `local`,
    each device's block put on it as it is laid out there."""
    import jax

    first, count = _local_positions()
    devices = mesh_devices()[first : first + count]
    blocks = np.ascontiguousarray(local).reshape(count, -1)
    with out_of_memory.raised_as_torch():
        placed = [jax.device_put(block, device) for block, device in zip(blocks, devices)]
    return jax.make_array_from_single_device_arrays((math.prod(shape),), flat_sharding(), placed)


def to_jax(tensor: torch.Tensor) -> "jax.Array":
    """The value of a `tpu` tensor as a `jax.Array` of its shape (rows sharded over the mesh if
    the tensor is sharded). No copy for a tensor that covers its whole storage."""
    from torchtpu.exec import memory

    return memory.to_array(tensor).reshape(tuple(tensor.shape))


def shard(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded copy of `tensor` (a `tpu` or CPU tensor), split by rows over `mesh()`.

    In a multi-process job every process passes the same full tensor and keeps its own blocks."""
    from torchtpu.exec import memory

    _check_rows(tuple(tensor.shape), "shard")
    if tensor.device.type == "tpu" and runtime.runtime().process_count == 1:
        flat = _flat(memory.to_array(tensor))
    else:  # each process keeps its own rows, as it holds only its own devices
        host = memory.torch_to_numpy(tensor.cpu())
        rows = host.shape[0] // len(mesh_devices())
        first, count = _local_positions()
        flat = _flat_from_local(host[first * rows : (first + count) * rows], tuple(tensor.shape))
    return _wrap(flat, tensor.dtype, tuple(tensor.shape))


def _wrap(flat: "jax.Array", dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    buffer = storage.DeviceBuffer(dtype, flat.shape[0], _home(), flat)
    buffer.sharded = True
    return storage.new_tensor(buffer, shape)


def local_shards(tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """This process's blocks of a sharded tensor as (first row, CPU tensor) pairs."""
    from torchtpu.exec import memory

    value = to_jax(tensor)
    out = []
    for block in sorted(value.addressable_shards, key=lambda s: s.index[0].start or 0):
        start = block.index[0].start or 0
        out.append((start, memory.numpy_to_torch(np.asarray(block.data))))
    return out


def _home() -> int:
    """The torch device index of sharded tensors: the mesh's first device of this process."""
    return 0
