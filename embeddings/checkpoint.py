"""Sharded, atomic checkpoints of SparseCore embedding modules with `torch.distributed.checkpoint`.

Each process writes only its own rows: `sharded_state_dict(module)` holds every table and optimizer
slot as `RowBlocks`, this process's equal blocks of the table's rows (`StackedState.local_blocks`),
under TorchRec's names and shapes. DCP records them as chunks of the whole `[V, dim]` tensor, so
the checkpoint does not depend on the topology that wrote it:

* another number of devices or SparseCores reads the blocks it now owns (DCP intersects chunks);
* a plain TorchRec `EmbeddingBagCollection` on CPU loads `{"model": ebc.state_dict()}` from it with
  DCP's default planner, for inference.

    state = sharded_state_dict(ebc)                 # {"model": {...}, "optim": {"state": {...}}}
    save(state, path)
    ...
    state = sharded_state_dict(other_ebc)          # blocks of the new topology, to load into
    load(state, path)                               # DCP reads into them
    load_sharded_state_dict(other_ebc, state)       # and they are written to the device

`save` is atomic: DCP writes a fresh sibling directory, and `path` (a symlink) is switched to it
with one `rename` once every process has written; a save that dies midway leaves the previous
checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from embeddings.optim import STEP_KEY, state_key
from embeddings.state import RowBlock, StackedState, TableSlot

__all__ = [
    "RowBlocks",
    "load",
    "load_sharded_state_dict",
    "save",
    "sharded_state_dict",
]


class RowBlocks(torch.Tensor):
    """This process's row blocks of one table slot, for DCP: a tensor of the slot's whole shape
    that holds only those blocks and speaks DCP's `_Checkpointable` protocol (as DTensor does).

    Saving writes each block as a chunk of the `[V, ...]` tensor; loading reads into the blocks,
    and `restore()` writes them to the module's state. It supports no tensor ops.
    """

    _state: StackedState
    _where: TableSlot
    blocks: list[RowBlock]

    @staticmethod
    def __new__(cls, state: StackedState, where: TableSlot, blocks: list[RowBlock]) -> RowBlocks:
        tensor = torch.Tensor._make_wrapper_subclass(cls, where.shape, dtype=torch.float32, device="cpu")
        tensor._state, tensor._where, tensor.blocks = state, where, blocks
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"RowBlocks only carries table rows to DCP; {func} is not supported on it")

    def __repr__(self) -> str:
        return f"RowBlocks({self._where.table!r}, slot={self._where.slot!r}, rows={[b.start for b in self.blocks]})"

    def _chunk(self, block: RowBlock) -> ChunkStorageMetadata:
        offsets = (block.start,) + (0,) * (len(self._where.shape) - 1)
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.values.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=torch.float32)
        return [
            WriteItem(
                index=MetadataIndex(fqn, self._chunk(block).offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=self._chunk(block), properties=properties, size=self.size()),
            )
            for block in self.blocks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(block) for block in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for block in self.blocks:
            if self._chunk(block).offsets == index.offset:
                return block.values
        raise ValueError(f"{index.fqn}: this process holds no block at {index.offset}")

    def restore(self) -> None:
        """Write the (loaded) blocks into the module's state."""
        self._state.load_local_blocks(self._where, self.blocks)


def sharded_state_dict(module: Any, prefix: str = "") -> dict[str, Any]:
    """A SparseCore module's checkpoint state, this process's rows only:
    `{"model": {<TorchRec weight name>: RowBlocks}, "optim": {"state": {<weight name>:
    {"<table>.<slot>": RowBlocks, "<table>.step": tensor}}}}` (names as `state_dict()` and
    `fused_optimizer.state_dict()` give them; `prefix` goes in front of the weight names)."""
    state: StackedState = module.stacked_state
    optimizer = module.fused_optimizer
    model, optim = {}, {}
    for table, key in optimizer.weight_keys.items():
        where = state.table_slot(table, None)
        model[prefix + key] = RowBlocks(state, where, state.local_blocks(where))
        entries: dict[str, Any] = {f"{table}.{STEP_KEY}": torch.tensor(state.step_count(table))}
        for slot in optimizer.slots(table):
            entries[f"{table}.{state_key(optimizer.optimizer, slot.slot)}"] = RowBlocks(
                state, slot, state.local_blocks(slot)
            )
        optim[prefix + key] = entries
    return {"model": model, "optim": {"state": optim}}


def load_sharded_state_dict(module: Any, state: dict[str, Any], prefix: str = "") -> None:
    """Write a `sharded_state_dict` that `load` filled into `module`."""
    optimizer = module.fused_optimizer
    for table, key in optimizer.weight_keys.items():
        state["model"][prefix + key].restore()
        entries = state["optim"]["state"][prefix + key]
        for slot in optimizer.slots(table):
            entries[f"{table}.{state_key(optimizer.optimizer, slot.slot)}"].restore()
        module.stacked_state.set_step_count(table, float(entries[f"{table}.{STEP_KEY}"]))


def _rank_and_token(process_group: dist.ProcessGroup | None) -> tuple[int, str]:
    """This rank, and a token every rank agrees on (rank 0's)."""
    token = [uuid.uuid4().hex]
    if not dist.is_initialized():
        return 0, token[0]
    dist.broadcast_object_list(token, src=0, group=process_group)
    return dist.get_rank(process_group), token[0]


def save(state: dict[str, Any], path: str | os.PathLike, process_group: dist.ProcessGroup | None = None) -> None:
    """Save `state` with DCP (each process its own rows), atomically: `path` becomes a symlink
    to a complete checkpoint or stays what it was. Every process of the group must call it."""
    path = Path(path)
    if path.exists() and not path.is_symlink():
        raise ValueError(
            f"{path} exists and is not a checkpoint written by embeddings.checkpoint.save (a symlink); "
            "it cannot be replaced atomically"
        )
    rank, token = _rank_and_token(process_group)
    version = path.parent / f".{path.name}.{token}"
    dcp.save(
        state,
        # No copy-ahead: it overlaps device-to-host copies with writing on a second stream, and a
        # tpu device has one in-order queue (`torch.tpu.Stream`). Each tensor is copied as it is
        # written (`RowBlocks` are host tensors already).
        storage_writer=dcp.FileSystemWriter(version, per_thread_copy_ahead=0),
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )
    if rank == 0:
        previous = path.resolve() if path.is_symlink() else None
        link = path.parent / f".{path.name}.{token}.link"
        os.symlink(version.name, link)
        os.replace(link, path)
        for stale in path.parent.glob(f".{path.name}.*"):
            if stale != version and (stale == previous or stale.is_dir()):
                shutil.rmtree(stale, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=process_group)


def load(state: dict[str, Any], path: str | os.PathLike, process_group: dist.ProcessGroup | None = None) -> None:
    """Load `state` in place from the checkpoint at `path` (`RowBlocks` read the rows this process
    holds). Every process of the group must call it."""
    dcp.load(
        state,
        storage_reader=dcp.FileSystemReader(Path(path).resolve()),
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )
