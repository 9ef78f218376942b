"""The fused optimizer of a DMP-sharded SparseCore kernel, as TorchRec sees it.

TorchRec gathers every kernel's `fused_optimizer` into the sharded module's (and DMP's)
`CombinedOptimizer`, whose `state_dict()` / `load_state_dict()` checkpoint the tables' optimizer
state beside the model's `state_dict()`. `ShardOptimizer` keeps the conventions of TorchRec's
FBGEMM kernels (`EmbeddingFusedOptimizer`), so a tpu checkpoint holds the entries a CPU or GPU
one holds and DCP reshards it onto another world size (a column-wise table's row-wise slot only
onto as many column shards, as with FBGEMM):

* `params`: each table's weight slice (TorchRec re-keys them `embedding_bags.<table>.weight`);
* `state[param]`: one entry per optimizer slot under FBGEMM's names (`<table>.momentum1` for the
  first, `<table>.exp_avg_sq` for Adam's second moment), a ShardedTensor of this process's shards
  of the table: shaped as the table for a per-element slot, `[rows]` for a row-wise one -- and
  for a column-wise table one `[rows]` block per column shard, in column order (`[rows x shards]`),
  since each column shard keeps its own row-wise slot;
* SGD tables have an empty state. The update count is not state: as with FBGEMM, a trainer that
  needs it (Adam's bias correction) sets it with `set_optimizer_step`.

The slots live stacked and MOD-sharded on the SparseCores, so `state` is a snapshot: reading it
copies every slot into host tensors in TorchRec's layout (their placements say `cpu`), and
`load_state_dict` copies into the last snapshot, which `post_load_state_dict` (called by
`load_state_dict`) writes to the SparseCores. The snapshot stays in host memory until the next
read or load.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.optim.fused import FusedOptimizer

from embeddings import SparseCoreEmbeddingBagCollection
from embeddings.optim import state_key
from embeddings.state import TableSlot
from sparsecore.optimizers import SlotSpec

__all__ = ["LocalTable", "ShardOptimizer"]


@dataclass(frozen=True)
class LocalTable:
    """One TorchRec table as a kernel holds it: its weight slice, and each of its local shards
    with the name of the collection table that holds the shard."""

    name: str
    weight: torch.Tensor
    shards: tuple[tuple[ShardedEmbeddingTable, str], ...]


@dataclass(frozen=True)
class _SlotLayout:
    """One slot of one table: where each local shard's values live in the SparseCore state, and
    the ShardedTensor metadata TorchRec gives them."""

    key: str
    places: tuple[TableSlot, ...]
    local: tuple[ShardMetadata, ...]
    global_metadata: ShardedTensorMetadata


class ShardOptimizer(FusedOptimizer):
    """TorchRec's view of a SparseCore kernel's fused optimizer (see the module docstring).

    `step` and `zero_grad` make the learning rate of `param_groups` take effect (the update
    itself runs in the backward)."""

    def __init__(self, collection: SparseCoreEmbeddingBagCollection, tables: Sequence[LocalTable],
                 pg: dist.ProcessGroup | None) -> None:
        # Not KeyedOptimizer.__init__: `state` is a property here, not an attribute.
        self._collection = collection
        self._pg = pg
        spec = collection.fused_optimizer.optimizer
        state = collection.stacked_state
        self._layouts = {
            table.weight: [_slot_layout(table, slot, state_key(spec, slot.name), state) for slot in spec.slots()]
            for table in tables
        }
        self._snapshot: dict[torch.Tensor, dict[str, ShardedTensor]] = {}
        self.params = {f"{table.name}.weight": table.weight for table in tables}
        self.param_groups = [{"params": list(self.params.values()),
                              "lr": collection.fused_optimizer.param_groups[0]["lr"]}]
        self.defaults: dict[str, Any] = {"_save_param_groups": False}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._patch_step_function()

    @property
    def state(self) -> dict[torch.Tensor, dict[str, ShardedTensor]]:  # type: ignore[override]
        """A fresh host snapshot of every table's slots (see the module docstring)."""
        self._snapshot = {
            weight: {layout.key: self._read(layout) for layout in layouts} for weight, layouts in self._layouts.items()
        }
        return self._snapshot

    def _read(self, layout: _SlotLayout) -> ShardedTensor:
        state = self._collection.stacked_state
        shards = [Shard(torch.from_numpy(state.to_host(place)), metadata)
                  for place, metadata in zip(layout.places, layout.local)]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, copy.deepcopy(layout.global_metadata), process_group=self._pg
        )

    def post_load_state_dict(self) -> None:
        """Write the snapshot that `load_state_dict` filled into the SparseCore slots."""
        slots = {}
        for weight, layouts in self._layouts.items():
            entries = self._snapshot.get(weight)
            if entries is None:
                raise RuntimeError("post_load_state_dict: no snapshot was loaded (read `state` first)")
            for layout in layouts:
                for place, shard in zip(layout.places, entries[layout.key].local_shards()):
                    slots[place] = shard.tensor.detach().numpy()
        self._collection.stacked_state.load_host_tables(slots)
        self._snapshot = {}

    def set_optimizer_step(self, step: int) -> None:
        """Set every table's update count (Adam's bias correction reads it)."""
        self._collection.fused_optimizer.set_optimizer_step(step)

    def step(self, closure: Any = None) -> None:
        self._collection.set_learning_rate(self.param_groups[0]["lr"])

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._collection.set_learning_rate(self.param_groups[0]["lr"])


def _slot_layout(table: LocalTable, slot: SlotSpec, key: str, state) -> _SlotLayout:
    config = table.shards[0][0]
    by_table_shard, size = _slot_shards(config, slot.per_row)
    return _SlotLayout(
        key=f"{table.name}.{key}",
        places=tuple(state.table_slot(name, slot.name) for _, name in table.shards),
        local=tuple(by_table_shard[shard.local_metadata] for shard, _ in table.shards),
        global_metadata=ShardedTensorMetadata(
            shards_metadata=[by_table_shard[m] for m in config.global_metadata.shards_metadata],
            size=torch.Size(size),
            tensor_properties=TensorProperties(dtype=torch.float32, requires_grad=False),
        ),
    )


def _slot_shards(config: ShardedEmbeddingTable, per_row: bool) -> tuple[dict[ShardMetadata, ShardMetadata], list[int]]:
    """The slot shard of each of the table's shards, and the slot's global size (TorchRec's
    layout, see the module docstring)."""
    shards = config.global_metadata.shards_metadata
    rows, cols = config.num_embeddings, config.embedding_dim

    def host(shard: ShardMetadata) -> str:
        return f"rank:{shard.placement.rank()}/cpu"

    if not per_row:
        return {m: ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), host(m)) for m in shards}, [rows, cols]
    column_split = config.local_cols != cols
    if column_split and config.local_rows != rows:
        raise ValueError(f"table {config.name!r}: split by rows and columns, its row-wise optimizer slot has no "
                         "TorchRec layout on tpu (plan it row-wise or column-wise)")
    if not column_split:
        return {m: ShardMetadata([m.shard_offsets[0]], [m.shard_sizes[0]], host(m)) for m in shards}, [rows]
    in_column_order = sorted(shards, key=lambda m: m.shard_offsets[1])
    return {m: ShardMetadata([i * rows], [rows], host(m)) for i, m in enumerate(in_column_order)}, [
        rows * len(in_column_order)
    ]
