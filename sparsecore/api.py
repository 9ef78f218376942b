"""Functional SparseCore embedding API: initialise, look up, update; what the torch side calls.

`SparseCoreEmbedding` binds stacked tables (`sparsecore.layout`) to a 1-D mesh of devices, one
MOD shard group per device. It owns two cached, jitted programs: the lookup of every stack and the
fused backward + optimizer update of every stack, which donates the tables, the optimizer state
and a gradient workspace (all zeros between steps: a step clears the rows its batch used as it
applies them), so a step never copies a table nor clears a whole workspace. State is plain pytrees:

* ``tables[stack]``: the stacked variable ``[N * rows_per_shard, dim]``, sharded over the mesh;
* ``slots[stack]``: the optimizer state, one array per slot of the stack's optimizer (same rows,
  width ``dim`` or 1) plus ``"step"``, the number of updates applied (Adam's bias correction), a
  float32 scalar as in `torch.optim.Adam` (exact to 2**24 steps, where beta**step is already 0);
* a batch: per stack, the packed host buffers (`sparsecore.preprocess.PackedBatch`), moved to the
  mesh by ``put_batch`` (host-side checks first) or passed as they are;
* activations and their gradients: per feature, ``[batch, dim]`` or ``[batch, max_seq_len, dim]``
  for sequence features.

Hyper-parameters (learning rate first) travel as float32 scalar arrays: changing them between steps
never recompiles. ``differentiable_lookup`` wraps both programs in a ``jax.custom_vjp`` for
pure-JAX training loops.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsecore.kernels import KernelGeometry, LocalKernels, local_kernels, workspace_rows
from sparsecore.layout import StackedTable, physical_row_ids, round_up, stack_and_shard, unshard_and_unstack
from sparsecore.optimizers import STEP
from sparsecore.preprocess import PackedBatch, buffer_sizes
from sparsecore.spec import NamedInitializer, TableSpec
from sparsecore.topology import Topology

Array = jax.Array
Tables = dict[str, Array]
Slots = dict[str, dict[str, Array]]
DeviceBatch = dict[str, dict[str, Array]]

AXIS = "sparsecore_devices"
"""Name of the mesh axis the kernels' collectives run over."""

_BUFFERS = ("row_pointers", "embedding_ids", "sample_ids", "gains")
_SCALAR_CACHE_SIZE = 64
_SIDE_CAR = ("entry_unique_index", "unique_ids")


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh over `devices`, in the given order (device i holds shards [i*S, (i+1)*S))."""
    return Mesh(np.asarray(list(devices), dtype=object), (AXIS,))


class SparseCoreEmbedding:
    """Lookup and update of a set of stacked tables on a mesh of `topology.global_device_count`
    devices (default: the first devices of `jax.devices()`). A caller whose arrays already live on
    a 1-D mesh (the `tpu` device's sharded tensors) passes that `mesh`: the kernels then run
    over its devices and its axis, so its arrays are read where they are.

    `kernels` defaults to the implementation for the devices' platform (`local_kernels`); tests
    pass the TPU kernels explicitly to inspect their lowering. `entry_chunk` / `row_chunk` tile
    the stand-in kernels' loops (see `KernelGeometry`).
    """

    def __init__(
        self,
        stacks: Sequence[StackedTable],
        topology: Topology,
        devices: Sequence[jax.Device] | None = None,
        kernels: LocalKernels | None = None,
        mesh: Mesh | None = None,
        **tiling: int,
    ) -> None:
        if mesh is not None:
            if devices is not None or len(mesh.axis_names) != 1:
                raise ValueError(
                    f"give either devices or a 1-D mesh, got devices={devices} and mesh axes {mesh.axis_names}"
                )
            devices = list(mesh.devices.flat)
        if devices is None:
            devices = jax.devices()[: topology.global_device_count]
        if len(devices) != topology.global_device_count:
            raise ValueError(
                f"topology has {topology.global_device_count} devices but {len(devices)} were given"
            )
        names = [stack.name for stack in stacks]
        if len(set(names)) != len(names):
            raise ValueError(f"stack names must be unique, got {names}")
        self.topology = topology
        self.mesh = mesh if mesh is not None else make_mesh(devices)
        self.axis = self.mesh.axis_names[0]
        """The mesh axis the kernels' collectives run over."""
        self.stacks = {stack.name: stack for stack in stacks}
        self.geometries = {
            stack.name: KernelGeometry.for_stack(stack, topology, buffer_sizes(stack, topology), **tiling)
            for stack in stacks
        }
        self._kernels = kernels or local_kernels(devices[0].platform)
        self._sharded = NamedSharding(self.mesh, P(self.axis))
        self._replicated = NamedSharding(self.mesh, P())
        self.lookup_program = jax.jit(self.lookup_fn)
        """`lookup_fn` jitted: what `lookup` runs (`.lower(...)` shows its HLO)."""
        self.update_program = jax.jit(self.update_fn, donate_argnums=(0, 1, 2))
        """`update_fn` jitted with tables, slots and workspaces donated: what `update` runs."""
        self._workspaces: dict[str, Array] | None = None
        self._table_initializers: dict[tuple, Callable[[Array, Array, Array], Array]] = {}
        self._scalars: dict[float, Array] = {}

    # ----------------------------------------------------------------------------- state

    def init(self, key: Array) -> tuple[Tables, Slots]:
        """Tables from each `TableSpec.initializer` (padding rows zero) and fresh optimizer
        state, created directly sharded on the mesh. Tables are written one at a time into their
        donated stack, so the peak memory is one stack plus one table's initial values (drawn
        for up to an eighth more rows, see `_draw_rows`)."""
        tables = {}
        index = 0
        for name, stack in self.stacks.items():
            shape = (stack.num_sparsecores * stack.rows_per_shard, stack.embedding_dim)
            table = jax.jit(functools.partial(jnp.zeros, shape, jnp.float32), out_shardings=self._sharded)()
            for placement in stack.tables:
                spec = placement.table
                rows = physical_row_ids(stack, spec.name)
                draw_rows = _draw_rows(spec)
                # Rows past the table's own are written nowhere: each gets its own index past
                # the stack's end, which the scatter drops.
                padding = shape[0] + np.arange(draw_rows - len(rows))
                rows = jnp.asarray(np.concatenate([rows, padding]), jnp.int32)
                write = self._table_initializer(spec.initializer, draw_rows, spec.embedding_dim)
                table = write(table, jax.random.fold_in(key, index), rows)
                index += 1
            tables[name] = table
        return tables, self.init_slots()

    def _table_initializer(self, initializer: Callable, rows: int, dim: int) -> Callable[[Array, Array, Array], Array]:
        """`(stack, key, physical rows) -> stack` writing `initializer`'s values for `rows` rows
        of `dim` columns at those rows; one program per (initializer, rows, dim, stack shape)."""
        cache_key = (initializer, rows, dim)
        if cache_key not in self._table_initializers:

            def write(stack: Array, key: Array, physical_rows: Array) -> Array:
                values = initializer(key, (rows, dim), jnp.float32)
                return stack.at[physical_rows, :dim].set(values, mode="drop", unique_indices=True)

            self._table_initializers[cache_key] = jax.jit(write, donate_argnums=0, out_shardings=self._sharded)
        return self._table_initializers[cache_key]

    def init_slots(self) -> Slots:
        """Every stack's optimizer slots at their initial values, and a step count of 0."""
        return self._init_slots()

    @functools.cached_property
    def _init_slots(self) -> Callable[[], Slots]:
        def build() -> Slots:
            slots: Slots = {}
            for name, stack in self.stacks.items():
                rows = stack.num_sparsecores * stack.rows_per_shard
                state = {
                    slot.name: jnp.full((rows, slot.width(stack.embedding_dim)), slot.initial_value, jnp.float32)
                    for slot in stack.optimizer.slots()
                }
                state[STEP] = jnp.zeros((), jnp.float32)
                slots[name] = state
            return slots

        shardings = {
            name: {**{slot.name: self._sharded for slot in stack.optimizer.slots()}, STEP: self._replicated}
            for name, stack in self.stacks.items()
        }
        return jax.jit(build, out_shardings=shardings)

    def place_tables(self, values: Mapping[str, np.ndarray]) -> Tables:
        """Stacked, sharded tables from unstacked values `[vocab, dim]` by table name."""
        known = {table for stack in self.stacks.values() for table in stack.table_names}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"values for unknown table(s) {unknown}; the stacks hold {sorted(known)}")
        return {
            name: self._place(
                stack_and_shard(stack, {t: values[t] for t in stack.table_names if t in values}, pad_value=0.0)
            )
            for name, stack in self.stacks.items()
        }

    def place_slots(self, values: Mapping[str, Mapping[str, np.ndarray]], step: int = 0) -> Slots:
        """Optimizer state from unstacked values by table name, then slot name; `step` updates
        have already been applied."""
        slots: Slots = {}
        for name, stack in self.stacks.items():
            state = {}
            for slot in stack.optimizer.slots():
                per_table = {table: values[table][slot.name] for table in stack.table_names}
                stacked = stack_and_shard(stack, per_table, pad_value=slot.initial_value, per_row=slot.per_row)
                state[slot.name] = self._place(stacked.reshape(stacked.shape[0] * stacked.shape[1], -1))
            state[STEP] = jax.device_put(jnp.asarray(step, jnp.float32), self._replicated)
            slots[name] = state
        return slots

    def _place(self, stacked: np.ndarray) -> Array:
        stacked = np.ascontiguousarray(stacked.reshape(-1, stacked.shape[-1]), dtype=np.float32)
        return jax.make_array_from_callback(stacked.shape, self._sharded, lambda index: stacked[index])

    def unstack_tables(self, tables: Tables) -> dict[str, np.ndarray]:
        """Every table's values `[vocab, dim]` by table name, gathered to the host."""
        out = {}
        for name, stack in self.stacks.items():
            out.update(unshard_and_unstack(stack, _to_host(tables[name])))
        return out

    def unstack_slots(self, slots: Slots) -> dict[str, dict[str, np.ndarray]]:
        """Every table's slots (`[vocab, dim]` or `[vocab, 1]`) by table name, then slot name."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for name, stack in self.stacks.items():
            for slot in stack.optimizer.slots():
                values = unshard_and_unstack(stack, _to_host(slots[name][slot.name]), per_row=slot.per_row)
                for table, array in values.items():
                    out.setdefault(table, {})[slot.name] = array
        return out

    # ----------------------------------------------------------------------------- batches

    def put_batch(self, packed: Mapping[str, PackedBatch]) -> DeviceBatch:
        """Check this host's packed buffers against the compiled shapes and move them to the
        mesh. Raises `ValueError` naming the stack, device, SparseCore and partition at fault."""
        host = self.host_arrays(packed)
        placed = iter(self._put_local([value for arrays in host.values() for value in arrays.values()]))
        return {name: {field: next(placed) for field in arrays} for name, arrays in host.items()}

    def host_arrays(self, packed: Mapping[str, PackedBatch]) -> dict[str, dict[str, np.ndarray]]:
        """This host's packed buffers checked against the compiled shapes (as `put_batch` does),
        per stack and field (`[local devices, ...]`, side-car included): for a caller that moves
        them to the devices its own way."""
        missing = sorted(set(self.stacks) - set(packed))
        if missing:
            raise ValueError(f"batch has no buffers for stack(s) {missing}")
        batch: dict[str, dict[str, np.ndarray]] = {}
        for name, geometry in self.geometries.items():
            host = packed[name]
            _check_buffers(host, geometry, self.topology.local_device_count)
            arrays = {field: getattr(host, field) for field in _BUFFERS}
            if host.unique is not None:
                arrays["entry_unique_index"] = host.unique.entry_unique_index
                arrays["unique_ids"] = host.unique.unique_ids
            batch[name] = arrays
        return batch

    def _put_local(self, local: list[np.ndarray]) -> list[Array]:
        """This host's rows (`[local devices, ...]` each) of global arrays sharded over the mesh.
        With one process the rows are the arrays, and one `device_put` moves them all (a call
        per array cost ~50 us more each)."""
        if jax.process_count() == 1:
            return jax.device_put([np.ascontiguousarray(a) for a in local], self._sharded)
        return [
            jax.make_array_from_process_local_data(
                self._sharded, np.ascontiguousarray(a), (self.topology.global_device_count, *a.shape[1:])
            )
            for a in local
        ]

    def _device_batch(self, batch: Mapping[str, Any]) -> DeviceBatch:
        first = next(iter(batch.values()), None)
        return self.put_batch(batch) if isinstance(first, PackedBatch) else dict(batch)

    # ----------------------------------------------------------------------------- steps

    def lookup(self, tables: Tables, batch: Mapping[str, Any]) -> dict[str, Array]:
        """Activations of every feature of every stack (jitted; nothing donated)."""
        return self.lookup_program(tables, self._device_batch(batch))

    def update(
        self,
        tables: Tables,
        slots: Slots,
        batch: Mapping[str, Any],
        activation_grads: Mapping[str, Array],
        hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> tuple[Tables, Slots]:
        """Apply one optimizer step from the activations' gradients; `tables` and `slots` are
        donated (do not use them afterwards). `hyperparameters[stack][name]` overrides the spec's
        value for this step."""
        batch = self._device_batch(batch)
        workspaces = self._workspaces if self._workspaces is not None else self._new_workspaces()
        self._workspaces = None
        tables, slots, self._workspaces = self.update_program(
            tables, slots, workspaces, batch, dict(activation_grads), self.hyperparameters(hyperparameters)
        )
        return tables, slots

    def hyperparameters(self, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Per stack, its optimizer's hyper-parameters as float32 scalars replicated on the mesh,
        with `overrides` (Python numbers or arrays). Arrays for Python numbers are cached by
        value, so a step whose values did not change transfers nothing."""
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.stacks))
        if unknown:
            raise ValueError(f"hyper-parameters for unknown stack(s) {unknown}; stacks: {sorted(self.stacks)}")
        values = {}
        for name, stack in self.stacks.items():
            defaults = stack.optimizer.hyperparameters()
            given = overrides.get(name, {})
            extra = sorted(set(given) - set(defaults))
            if extra:
                raise ValueError(
                    f"stack {name!r} ({type(stack.optimizer).__name__}) has no hyper-parameter(s) "
                    f"{extra}; it has {sorted(defaults)}"
                )
            values[name] = {k: self._replicated_scalar(given.get(k, v)) for k, v in defaults.items()}
        return values

    def _replicated_scalar(self, value: Any) -> Array:
        if isinstance(value, jax.Array):
            return jax.device_put(value.astype(jnp.float32).reshape(()), self._replicated)
        value = float(value)
        if value not in self._scalars:
            if len(self._scalars) >= _SCALAR_CACHE_SIZE:  # a schedule: forget the oldest value
                del self._scalars[next(iter(self._scalars))]
            self._scalars[value] = jax.device_put(np.float32(value), self._replicated)
        return self._scalars[value]

    def _new_workspaces(self) -> dict[str, Array]:
        return {
            name: jax.device_put(
                jnp.zeros((self.topology.global_device_count * workspace_rows(g), g.embedding_dim), jnp.float32),
                self._sharded,
            )
            for name, g in self.geometries.items()
        }

    def new_workspaces(self) -> dict[str, Array]:
        """Gradient workspaces for `update_fn` (the `update` method keeps its own)."""
        return self._new_workspaces()

    # ----------------------------------------------------------------------------- programs

    def lookup_fn(self, tables: Tables, batch: DeviceBatch) -> dict[str, Array]:
        """The traceable lookup of all stacks (what `lookup` jits)."""
        activations = {}
        for name in self.stacks:
            activations.update(self.lookup_stack_features(name, tables[name], batch[name]))
        return activations

    def lookup_stack(self, name: str, table: Array, buffers: Mapping[str, Array]) -> Array:
        """The traceable lookup of one stack: its activations `[N*B, D]`, SparseCore-major (the
        B samples of SparseCore 0 first, each feature at its `sample_offset_in_sparsecore`)."""
        return self._sharded_lookup(name, self._kernels.lookup, table, buffers)

    def lookup_stack_features(self, name: str, table: Array, buffers: Mapping[str, Array]) -> dict[str, Array]:
        """The traceable lookup of one stack as each of its features' output, from the kernels'
        per-feature activations (`LocalKernels.lookup_by_feature`): a kernel that writes them
        itself spares the copy of each feature's block out of the stack's `[N*B, D]`."""
        blocks = self._sharded_lookup(name, self._kernels.lookup_by_feature, table, buffers)
        return {
            placement.feature.name: block.reshape(placement.feature.output_shape)
            for placement, block in zip(self.stacks[name].features, blocks, strict=True)
        }

    def _sharded_lookup(
        self, name: str, kernel: Callable, table: Array, buffers: Mapping[str, Array]
    ) -> Array | tuple[Array, ...]:
        """A per-device lookup of one stack (`LocalKernels.lookup`'s arguments) over the mesh: each
        of its outputs the devices' parts in device order."""
        kernel = functools.partial(kernel, geometry=self.geometries[name], axis_name=self.axis)
        local = jax.shard_map(
            lambda rp, ids, samples, gains, table: kernel(rp[0], ids[0], samples[0], gains[0], table),
            mesh=self.mesh,
            in_specs=(P(self.axis),) * 5,
            out_specs=P(self.axis),
            check_vma=self._kernels.lookup_check_vma,
        )
        return local(*(buffers[field] for field in _BUFFERS), table)

    def update_fn(
        self,
        tables: Tables,
        slots: Slots,
        workspaces: Mapping[str, Array],
        batch: DeviceBatch,
        activation_grads: Mapping[str, Array],
        hyperparameters: Mapping[str, Mapping[str, Array]],
    ) -> tuple[Tables, Slots, dict[str, Array]]:
        """The traceable update of all stacks (what `update` jits, donating the first three)."""
        new_tables, new_slots, new_workspaces = {}, {}, {}
        for name, geometry in self.geometries.items():
            grads = self._stack_activation_grads(self.stacks[name], geometry, activation_grads)
            new_tables[name], new_slots[name], new_workspaces[name] = self.update_stack(
                name, tables[name], slots[name], workspaces[name], batch[name], grads, hyperparameters[name]
            )
        return new_tables, new_slots, new_workspaces

    def update_stack(
        self,
        name: str,
        table: Array,
        slots: Mapping[str, Array],
        workspace: Array,
        buffers: Mapping[str, Array],
        activation_grads: Array,
        hyperparameters: Mapping[str, Array],
    ) -> tuple[Array, dict[str, Array], Array]:
        """The traceable update of one stack from its activations' gradient `[N*B, D]` (the
        layout `lookup_stack` returns): the new table, slots (with `STEP` counted) and workspace
        (`[devices * workspace_rows, D]`: given all zeros, as `new_workspaces` makes it and every
        update leaves it, and returned so)."""
        missing = [field for field in _SIDE_CAR if field not in buffers]
        if missing:
            raise ValueError(
                f"stack {name!r}: the batch has no unique-row side-car; preprocess it with "
                "with_unique_rows=True to update"
            )
        state = dict(slots)
        step = state.pop(STEP) + 1
        hyper = {**hyperparameters, STEP: step}
        kernel = functools.partial(
            self._kernels.update, geometry=self.geometries[name], optimizer=self.stacks[name].optimizer,
            axis_name=self.axis,
        )
        local = jax.shard_map(
            lambda rp, ids, samples, gains, index, unique, grads, table, state, workspace, hyper: kernel(
                rp[0], ids[0], samples[0], gains[0], index[0], unique[0], grads, table, state, workspace, hyper
            ),
            mesh=self.mesh,
            in_specs=(P(self.axis),) * 10 + (P(),),
            out_specs=(P(self.axis), P(self.axis), P(self.axis)),
        )
        table, state, workspace = local(
            *(buffers[field] for field in _BUFFERS + _SIDE_CAR), activation_grads, table, state, workspace, hyper
        )
        return table, {**state, STEP: step}, workspace

    @staticmethod
    def _stack_activation_grads(
        stack: StackedTable, geometry: KernelGeometry, grads: Mapping[str, Array]
    ) -> Array:
        """Each feature's activation gradient -> the stack's `[N*B, D]`, SparseCore-major."""
        parts = []
        for placement in sorted(stack.features, key=lambda p: p.sample_offset_in_sparsecore):
            feature = placement.feature
            if feature.name not in grads:
                raise ValueError(f"stack {stack.name!r}: no activation gradient for feature {feature.name!r}")
            grad = grads[feature.name]
            if tuple(grad.shape) != feature.output_shape:
                raise ValueError(
                    f"feature {feature.name!r}: activation gradient has shape {tuple(grad.shape)}, "
                    f"expected {feature.output_shape}"
                )
            grad = grad.astype(jnp.float32).reshape(
                geometry.num_sparsecores, placement.samples_per_sparsecore, feature.table.embedding_dim
            )
            parts.append(jnp.pad(grad, ((0, 0), (0, 0), (0, stack.embedding_dim - feature.table.embedding_dim))))
        return jnp.concatenate(parts, axis=1).reshape(-1, stack.embedding_dim)


def differentiable_lookup(
    engine: SparseCoreEmbedding,
) -> Callable[[Tables, Slots, DeviceBatch, Mapping[str, Mapping[str, Array]]], dict[str, Array]]:
    """`f(tables, slots, batch, hyperparameters) -> activations` with a custom VJP for pure JAX.

    The cotangents `jax.grad` returns for `tables` and `slots` are their *updated values* after
    one optimizer step (SparseCore applies the optimizer inside the backward), not gradients:
    use them as the new state. Batch and hyper-parameters get zero cotangents. Inside one
    jitted step the forward gather and the in-place update share a computation, which can make
    XLA copy the tables; for large tables call `lookup` and `update` instead.
    """

    @jax.custom_vjp
    def lookup(tables, slots, batch, hyperparameters):
        return engine.lookup_fn(tables, batch)

    def forward(tables, slots, batch, hyperparameters):
        return engine.lookup_fn(tables, batch), (tables, slots, batch, hyperparameters)

    def backward(residuals, activation_grads):
        tables, slots, batch, hyperparameters = residuals
        workspaces = {
            name: jnp.zeros((engine.topology.global_device_count * workspace_rows(g), g.embedding_dim), jnp.float32)
            for name, g in engine.geometries.items()
        }
        new_tables, new_slots, _ = engine.update_fn(
            tables, slots, workspaces, batch, activation_grads, hyperparameters
        )
        return new_tables, new_slots, jax.tree.map(_zero_cotangent, batch), jax.tree.map(jnp.zeros_like, hyperparameters)

    lookup.defvjp(forward, backward)
    return lookup


def _zero_cotangent(x: Array) -> Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _to_host(array: Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _check_buffers(batch: PackedBatch, geometry: KernelGeometry, local_devices: int) -> None:
    """Shapes against the compiled geometry, and row pointers that only address real partitions
    of at most `max_ids_per_partition` entries inside their SparseCore's segment."""
    s, r, n = geometry.sparsecores_per_device, geometry.row_pointers_per_sparsecore, geometry.num_sparsecores
    expected = {
        "row_pointers": (local_devices, s * r),
        "embedding_ids": (local_devices, geometry.coo_buffer_size),
        "sample_ids": (local_devices, geometry.coo_buffer_size),
        "gains": (local_devices, geometry.coo_buffer_size),
    }
    if batch.unique is not None:
        expected["entry_unique_index"] = (local_devices, geometry.coo_buffer_size)
        expected["unique_ids"] = (local_devices, n, geometry.unique_rows_per_partition)
    for field, shape in expected.items():
        value = getattr(batch.unique, field) if field in _SIDE_CAR else getattr(batch, field)
        if tuple(value.shape) != shape:
            raise ValueError(
                f"stack {geometry.name!r}: {field} has shape {tuple(value.shape)}, the compiled "
                f"kernels expect {shape} (were the limits changed without a new SparseCoreEmbedding?)"
            )
    ends = batch.row_pointers.reshape(local_devices, s, r)[..., :n].astype(np.int64)
    starts = np.concatenate([np.zeros_like(ends[..., :1]), (ends[..., :-1] + 7) // 8 * 8], axis=-1)
    counts = ends - starts
    bad = (counts < 0) | (counts > geometry.max_ids_per_partition) | (ends > geometry.segment_size)
    if bad.any():
        device, sparsecore, partition = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"stack {geometry.name!r}: local device {device}, SparseCore {sparsecore}, partition "
            f"{partition}: row pointers give {int(counts[device, sparsecore, partition])} entries ending at "
            f"{int(ends[device, sparsecore, partition])}; allowed are 0..{geometry.max_ids_per_partition} "
            f"entries (max_ids_per_partition) ending inside the {geometry.segment_size}-slot segment"
        )


_MIN_DRAW_ROWS = 64


def _draw_rows(spec: TableSpec) -> int:
    """How many rows a table's initial values are drawn for: its vocabulary rounded up (by less
    than an eighth) to a number with at most four significant bits, and at least 64, where that
    gives the same values, so that tables of nearby sizes share one compiled initializer -- a
    model of many tables otherwise compiles one program per table at start-up.

    The same values: a `NamedInitializer` draws each element from the key and its position
    alone under JAX's partitionable threefry (row i of a draw of any row count is the same), so
    the first `vocabulary_size` rows of the larger draw are the table's exact-size draw. Other
    initializers (arbitrary callables) draw exactly the table's rows."""
    rows = spec.vocabulary_size
    if not (isinstance(spec.initializer, NamedInitializer) and jax.config.jax_threefry_partitionable):
        return rows
    step = 1 << max(rows.bit_length() - 4, 0)
    return max(round_up(rows, step), _MIN_DRAW_ROWS)
