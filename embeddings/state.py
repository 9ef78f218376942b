"""The state of a SparseCore embedding module: stacked tables, optimizer slots, update counts and
hyper-parameters, and the per-table views of it that checkpoints and `state_dict` use.

Every stacked table is `sparsecore`'s MOD-sharded variable `[N * rows_per_shard, dim]`, held as a
sharded `tpu` tensor (`torchtpu.sharding`): device d holds its SparseCores' shards, and the ops
read the tensor's buffer as the same global `jax.Array`, without a copy. Tables are parameters
(so the lookup's output requires grad) that never get a `.grad`: the fused update writes them.
Slots are buffers of the same rows; each stack's update count is a `[devices]` buffer (one copy
per device, so it is sharded like everything else); hyper-parameters are 0-dim float32 CPU
tensors, runtime inputs of the update ops. Each stack also keeps the stand-in update's gradient
workspace (all zeros between steps; see `embeddings.ops`), which is scratch, not state: no
checkpoint or `state_dict` holds it.

Per-table values ("rows") are built on the device by a gather through `physical_row_ids` (and
written back by the matching scatter): a `[V', width]` array sharded over the mesh in equal row
blocks (V' = the vocabulary rounded up to the device count). Whole tables go to the host from
there; a checkpoint writes each process's blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch import nn

from embeddings.ops import StackComputation
from sparsecore.api import SparseCoreEmbedding
from sparsecore.layout import StackedTable, physical_row_ids, round_up
from sparsecore.optimizers import CLIP, OptimizerSpec, SlotSpec
from torchtpu import out_of_memory, sharding
from torchtpu.exec import memory

__all__ = ["RowBlock", "StackedState", "TableSlot"]

@dataclass(frozen=True)
class TableSlot:
    """Where one table's weights (slot None) or one of its optimizer slots live."""

    table: str
    slot: str | None
    stack: StackedTable

    @property
    def spec(self) -> SlotSpec | None:
        if self.slot is None:
            return None
        return next(s for s in self.stack.optimizer.slots() if s.name == self.slot)

    @property
    def shape(self) -> tuple[int, ...]:
        """The TorchRec shape: `[V, dim]`, `[V]` for a row-wise slot."""
        spec = self.stack.table(self.table).table
        if self.spec is not None and self.spec.per_row:
            return (spec.vocabulary_size,)
        return (spec.vocabulary_size, spec.embedding_dim)

    @property
    def width(self) -> int:
        """Columns of each row: 1 for a row-wise slot, else the table's dim."""
        return 1 if len(self.shape) == 1 else self.shape[1]


@dataclass(frozen=True)
class RowBlock:
    """Rows [start, start + len(values)) of a table slot, on the host."""

    start: int
    values: torch.Tensor


class StackedState(nn.Module):
    """Tables, slots, update counts and hyper-parameters of one module's stacks.

    Its tensors are registered here (so `torch.compile` lifts them as graph inputs) but are not
    part of `state_dict()`: the owning module exposes them per table under TorchRec's names.
    """

    def __init__(
        self,
        engine: SparseCoreEmbedding,
        computations: Mapping[str, StackComputation],
        optimizer: OptimizerSpec,
        seed: int,
        host_initializers: Mapping[str, Callable[[torch.Tensor], object]],
    ) -> None:
        super().__init__()
        self.engine = engine
        self.computations = dict(computations)
        self._sharded = NamedSharding(engine.mesh, P(engine.axis))
        self._index = {name: i for i, name in enumerate(self.computations)}
        with out_of_memory.raised_as_torch():  # the tables take most of the device's memory
            tables, slots = engine.init(jax.random.key(seed))
        devices = engine.topology.global_device_count
        for name, i in self._index.items():
            table = nn.Parameter(sharding.from_jax(tables[name]))
            self.register_parameter(f"table_{i}", table)
            for slot in engine.stacks[name].optimizer.slots():
                value = sharding.from_jax(slots[name][slot.name])
                self.register_buffer(f"slot_{i}_{slot.name}", value, persistent=False)
            step = jax.device_put(jnp.zeros(devices, jnp.float32), self._sharded)
            self.register_buffer(f"step_{i}", sharding.from_jax(step), persistent=False)
        self._register_workspaces()
        values = {CLIP: math.inf, **optimizer.hyperparameters()}
        for name, value in values.items():
            self.register_buffer(f"hyper_{name}", torch.tensor(value, dtype=torch.float32), persistent=False)
        # What the hyper-parameter tensors hold, known without reading them back from the device.
        self._hyperparameter_values = {name: float(getattr(self, f"hyper_{name}")) for name in values}
        self._slots_of = {name: tuple(s.name for s in engine.stacks[name].optimizer.slots()) for name in self._index}
        self._table_stack = {t: engine.stacks[s] for s in self._index for t in engine.stacks[s].table_names}
        self._initialize_on_host(host_initializers)

    def rebind(self, engine: SparseCoreEmbedding, computations: Mapping[str, StackComputation]) -> None:
        """Serve the same tables to another engine (e.g. laid out for another batch size): its
        stacks must hold the same tables, in the same places, as this state's."""
        def tables_of(stacks: Mapping[str, StackedTable]) -> dict[str, tuple]:
            return {name: (s.tables, s.embedding_dim, s.rows_per_shard) for name, s in stacks.items()}

        if list(computations) != list(self._index) or tables_of(engine.stacks) != tables_of(self.engine.stacks):
            raise ValueError(
                f"rebind: the new stacks {sorted(engine.stacks)} do not hold this state's tables as "
                f"{sorted(self.engine.stacks)} do"
            )
        self.engine = engine
        self.computations = dict(computations)
        self._table_stack = {t: engine.stacks[s] for s in self._index for t in engine.stacks[s].table_names}
        self._register_workspaces()  # sized by the layout's buffers, which may have changed

    def _register_workspaces(self) -> None:
        workspaces = self.engine.new_workspaces()
        for name, i in self._index.items():
            self.register_buffer(f"workspace_{i}", sharding.from_jax(workspaces[name]), persistent=False)

    # -- the op operands ------------------------------------------------------------------------

    def table(self, stack: str) -> nn.Parameter:
        return getattr(self, f"table_{self._index[stack]}")

    def slots(self, stack: str) -> tuple[torch.Tensor, ...]:
        """The stack's optimizer slots, in the order of its optimizer's `slots()`."""
        i = self._index[stack]
        return tuple(getattr(self, f"slot_{i}_{slot}") for slot in self._slots_of[stack])

    def step(self, stack: str) -> torch.Tensor:
        return getattr(self, f"step_{self._index[stack]}")

    def workspace(self, stack: str) -> torch.Tensor:
        """The stack's gradient workspace (all zeros between updates)."""
        return getattr(self, f"workspace_{self._index[stack]}")

    def hyperparameters(self, optimizer: OptimizerSpec) -> tuple[torch.Tensor, ...]:
        """The update ops' hyper-parameter inputs: learning rate, the optimizer's own, clipping."""
        names = ("learning_rate", *type(optimizer).HYPERPARAMETERS, CLIP)
        return tuple(getattr(self, f"hyper_{name}") for name in names)

    def set_hyperparameter(self, name: str, value: float) -> None:
        """Set a hyper-parameter of the fused update. The tensor is written only when the value
        changes: the lookups of a forward save it for their backward, and fused optimizers set
        the learning rate on every `step` and `zero_grad` -- also between a forward and its
        backward, where an in-place write of the same value would fail the backward."""
        tensor = getattr(self, f"hyper_{name}", None)
        if tensor is None:
            raise ValueError(f"the optimizer has no hyper-parameter {name!r}")
        value = float(torch.tensor(value, dtype=torch.float32))  # the value the update reads
        if self._hyperparameter_values.get(name) != value:
            tensor.fill_(value)
            self._hyperparameter_values[name] = value

    def hyperparameter(self, name: str) -> float:
        if not hasattr(self, f"hyper_{name}"):
            raise ValueError(f"the optimizer has no hyper-parameter {name!r}")
        return self._hyperparameter_values[name]

    # -- per-table views ------------------------------------------------------------------------

    def table_slots(self) -> list[TableSlot]:
        """Every table's weights and optimizer slots, tables in stack order."""
        out = []
        for stack_name in self._index:
            stack = self.engine.stacks[stack_name]
            for table in stack.table_names:
                out.append(TableSlot(table, None, stack))
                out.extend(TableSlot(table, slot, stack) for slot in self._slots_of[stack_name])
        return out

    def table_slot(self, table: str, slot: str | None) -> TableSlot:
        return TableSlot(table, slot, self._table_stack[table])

    def step_count(self, table: str) -> float:
        """Updates applied to `table`'s stack."""
        step = sharding.local_shards(self.step(self._table_stack[table].name))[0][1]
        return float(step[0])

    def set_step_count(self, table: str, value: float) -> None:
        with torch.no_grad():
            self.step(self._table_stack[table].name).fill_(float(value))

    def _variable(self, where: TableSlot) -> torch.Tensor:
        if where.slot is None:
            return self.table(where.stack.name)
        i = self._index[where.stack.name]
        return getattr(self, f"slot_{i}_{where.slot}")

    def _rows_program(self, where: TableSlot) -> Callable[[jax.Array], jax.Array]:
        return _rows_program(where.stack, where.table, where.width, self._padded_rows(where), self._sharded)

    def _padded_rows(self, where: TableSlot) -> int:
        return round_up(where.shape[0], self.engine.topology.global_device_count)

    def rows(self, where: TableSlot) -> jax.Array:
        """The table slot's rows on the device: `[V', width]`, in equal row blocks per device."""
        return self._rows_program(where)(sharding.to_jax(self._variable(where)))

    def to_host(self, where: TableSlot) -> np.ndarray:
        """The whole table slot in TorchRec's shape (every process must call this together)."""
        rows = self.rows(where)
        host = np.asarray(rows if rows.is_fully_addressable else multihost_utils.process_allgather(rows, tiled=True))
        return np.array(host[: where.shape[0]].reshape(where.shape))

    def local_blocks(self, where: TableSlot) -> list[RowBlock]:
        """This process's row blocks of the table slot (in TorchRec's shape; empty blocks past the
        vocabulary left out)."""
        blocks = []
        rows = self.rows(where)
        for shard in sorted(rows.addressable_shards, key=lambda s: s.index[0].start or 0):
            start = shard.index[0].start or 0
            stop = min(start + shard.data.shape[0], where.shape[0])
            if stop > start:
                values = np.asarray(shard.data)[: stop - start].reshape(stop - start, *where.shape[1:])
                blocks.append(RowBlock(start, memory.numpy_to_torch(values.copy())))
        return blocks

    def empty_local_blocks(self, where: TableSlot) -> list[RowBlock]:
        """Zero blocks shaped like `local_blocks`, to load into."""
        padded = self._padded_rows(where)
        per_device = padded // self.engine.topology.global_device_count
        blocks = []
        for index in self._local_indices(padded):
            start = index[0].start or 0
            stop = min(start + per_device, where.shape[0])
            if stop > start:
                blocks.append(RowBlock(start, torch.zeros((stop - start, *where.shape[1:]), dtype=torch.float32)))
        return blocks

    def _local_indices(self, rows: int) -> list[tuple[slice, ...]]:
        """This process's row ranges of a `[rows, w]` array sharded like the rows, in order."""
        indices = self._sharded.addressable_devices_indices_map((rows, 1)).values()
        return sorted(indices, key=lambda index: index[0].start or 0)

    def load_local_blocks(self, where: TableSlot, blocks: list[RowBlock]) -> None:
        """Write this process's blocks (as `empty_local_blocks` shapes them) into the state."""
        padded = self._padded_rows(where)
        per_device = padded // self.engine.topology.global_device_count
        local = np.zeros((self.engine.topology.local_device_count * per_device, where.width), np.float32)
        first = min(index[0].start or 0 for index in self._local_indices(padded))
        for block in blocks:
            values = memory.torch_to_numpy(block.values).reshape(len(block.values), -1)
            local[block.start - first : block.start - first + len(values), : values.shape[1]] = values
        rows = jax.make_array_from_process_local_data(self._sharded, local, (padded, where.width))
        self._write_rows([(where, rows)])

    def load_host(self, where: TableSlot, values: np.ndarray) -> None:
        """Write a whole table slot given in TorchRec's shape (the same values on every process)."""
        self.load_host_tables({where: values})

    def load_host_tables(self, values: Mapping[TableSlot, np.ndarray]) -> None:
        """Write whole table slots given in TorchRec's shapes (the same values on every process).

        The slots of one stacked variable are written by one program: loading a model's tables
        rewrites each stack once, not once per table (26 full copies of a stack at MLPerf's 26)."""
        groups: dict[tuple[str, str | None], list[tuple[TableSlot, jax.Array]]] = {}
        for where, value in values.items():
            groups.setdefault((where.stack.name, where.slot), []).append((where, self._host_rows(where, value)))
        for group in groups.values():
            self._write_rows(group)

    def _host_rows(self, where: TableSlot, values: np.ndarray) -> jax.Array:
        """A whole table slot's values as its `[V', width]` rows, sharded like the rows."""
        values = np.asarray(values, dtype=np.float32)
        if values.shape != where.shape:
            raise ValueError(
                f"table {where.table!r}{'' if where.slot is None else f' slot {where.slot!r}'}: "
                f"expected shape {where.shape}, got {values.shape}"
            )
        padded = np.zeros((self._padded_rows(where), where.width), np.float32)
        padded[: where.shape[0]] = values.reshape(where.shape[0], where.width)
        return jax.make_array_from_callback(padded.shape, self._sharded, lambda index: padded[index])

    def _write_rows(self, group: list[tuple[TableSlot, jax.Array]]) -> None:
        """Write each table slot's rows into their (common) stacked variable, in one program."""
        variable = self._variable(group[0][0])
        program = _place_program(group[0][0].stack, tuple((where.table, where.width) for where, _ in group),
                                 self._sharded)
        updated = program(sharding.to_jax(variable), *(rows for _, rows in group))
        with torch.no_grad():
            variable.copy_(sharding.from_jax(updated))

    def _initialize_on_host(self, initializers: Mapping[str, Callable[[torch.Tensor], object]]) -> None:
        """Each table's weights from its initializer, run on a host tensor of TorchRec's shape."""
        values = {}
        for table, init in initializers.items():
            where = self.table_slot(table, None)
            host = torch.empty(where.shape, dtype=torch.float32)
            init(host)
            values[where] = memory.torch_to_numpy(host)
        self.load_host_tables(values)

    # -- fixed in place; excluded from state_dict (the owner exposes per-table values) ---------

    def _apply(self, fn, recurse: bool = True) -> StackedState:
        """Nothing: the tables stay sharded over the mesh and the hyper-parameters on the host
        (the ops read them there), whatever `Module.to()` asks of the model around them."""
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Nothing: the owning module saves its tables under TorchRec's names."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Nothing: the owning module loads its tables from TorchRec's names."""


@functools.lru_cache(maxsize=None)
def _rows_program(
    stack: StackedTable, table: str, width: int, padded_rows: int, out: NamedSharding
) -> Callable[[jax.Array], jax.Array]:
    """`stacked [N*R, w] -> rows [padded_rows, width]`: a table's rows gathered in id order,
    rows past the vocabulary zero."""
    vocabulary = stack.table(table).table.vocabulary_size
    rows = np.zeros(padded_rows, np.int32)
    rows[:vocabulary] = physical_row_ids(stack, table)

    def gather(stacked: jax.Array) -> jax.Array:
        valid = jnp.arange(padded_rows)[:, None] < vocabulary
        return jnp.where(valid, stacked[jnp.asarray(rows), :width], 0.0)

    return jax.jit(gather, out_shardings=out)


@functools.lru_cache(maxsize=None)
def _place_program(
    stack: StackedTable, tables: tuple[tuple[str, int], ...], out: NamedSharding
) -> Callable[..., jax.Array]:
    """`(stacked, rows_1 [V_1', width_1], ...) -> stacked` with the rows of each `(table, width)`
    written (padding kept)."""
    places = [(physical_row_ids(stack, table), stack.table(table).table.vocabulary_size, width)
              for table, width in tables]

    def place(stacked: jax.Array, *rows: jax.Array) -> jax.Array:
        for (physical, vocabulary, width), values in zip(places, rows):
            stacked = stacked.at[jnp.asarray(physical), :width].set(values[:vocabulary], unique_indices=True)
        return stacked

    return jax.jit(place, out_shardings=out)
