"""The SparseCore torch ops: `torch.ops.tpu.sparse_dense_matmul` and
`torch.ops.tpu.sparse_dense_matmul_grad_with_<optimizer>`, one per `sparsecore` optimizer.

Each op is one stack's program of `sparsecore.api.SparseCoreEmbedding` (`lookup_stack`,
`update_stack`) registered through `torchtpu.kernels.jax_kernel`, so it has a fake implementation
and runs in strict eager, DeferAndFuse and `torch.compile(backend="tpu")` graphs. Arguments follow
TorchTPU / jax-tpu-embedding: the packed buffers, the table (and its optimizer slots and update
count), the activations' gradient, then the hyper-parameters as 0-dim float32 tensors (learning
rate first: tensors, so changing them never recompiles), and the static arguments batch size,
limits and `computation_name`, which names the stack geometry a module registered with
`register_stack` (checked against the other static arguments). Modules with the same layout
share one name, and with it their compiled programs.

The buffers include the stand-in's unique-row side-car (`entry_unique_index`, `unique_ids`;
see `sparsecore.preprocess.UniqueRows`). The update ops are functional: they return the new table,
slots and step count, and the caller writes them back into its state. `clip_gradient` is read only
when the table's optimizer clips. After TorchTPU's arguments the update ops take
`gradient_workspace`, the stand-in kernel's scratch for accumulating row gradients
(`[devices * workspace_rows, D]` float32, all zeros; `StackedState` keeps one per stack): the
update leaves it all zeros again and returns it too, so a step clears only the rows it used
instead of making a zeroed one (31 MB on the mlperf DLRM) every step. A TPU kernel passes it
through untouched.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsecore.api import SparseCoreEmbedding
from sparsecore.layout import StackedTable
from sparsecore.optimizers import CLIP, OPTIMIZERS, STEP, OptimizerSpec
from torchtpu.kernels import JaxKernel, jax_kernel

__all__ = [
    "BUFFERS",
    "StackComputation",
    "register_stack",
    "sparse_dense_matmul",
    "update_kernel",
    "UPDATE_KERNELS",
]

BUFFERS = ("row_pointers", "embedding_ids", "sample_ids", "gains", "entry_unique_index", "unique_ids")
"""A stack's per-step inputs, each a `[devices, ...]` tensor sharded over the mesh: the packed
buffers (`sparsecore.preprocess.PackedBatch`), then the unique-row side-car."""

_LOOKUP_BUFFERS = BUFFERS[:4]

_STATIC = (
    inspect.Parameter("batch_size", inspect.Parameter.KEYWORD_ONLY, annotation=int),
    inspect.Parameter("max_ids_per_partition", inspect.Parameter.KEYWORD_ONLY, annotation=int),
    inspect.Parameter("max_unique_ids_per_partition", inspect.Parameter.KEYWORD_ONLY, annotation=int),
    inspect.Parameter("computation_name", inspect.Parameter.KEYWORD_ONLY, annotation=str),
)


@dataclass(frozen=True)
class StackComputation:
    """One stack of one module, as the ops see it: its engine, layout and registered name."""

    name: str
    engine: SparseCoreEmbedding
    stack: StackedTable

    @property
    def static_args(self) -> dict[str, Any]:
        """The ops' static arguments for this stack."""
        return {
            "batch_size": self.stack.total_sample_count,
            "max_ids_per_partition": self.stack.max_ids_per_partition,
            "max_unique_ids_per_partition": self.stack.max_unique_ids_per_partition,
            "computation_name": self.name,
        }

    @property
    def optimizer(self) -> OptimizerSpec:
        return self.stack.optimizer

    def lookup(self, values: Mapping[str, jax.Array]) -> jax.Array:
        buffers = {field: values[field] for field in _LOOKUP_BUFFERS}
        return self.engine.lookup_stack(self.stack.name, values["embedding_table"], buffers)

    def update(self, values: Mapping[str, jax.Array], slot_args: Mapping[str, str]) -> tuple[jax.Array, ...]:
        """`slot_args`: slot name -> the op argument holding it."""
        engine, optimizer = self.engine, self.optimizer
        sharded = NamedSharding(engine.mesh, P(engine.axis))
        step = values["step"]
        slots = {name: values[arg] for name, arg in slot_args.items()}
        slots[STEP] = step[0]
        table, slots, workspace = engine.update_stack(
            self.stack.name,
            values["embedding_table"],
            slots,
            values["gradient_workspace"],
            {field: values[field] for field in BUFFERS},
            values["activations_grad"],
            {name: values[name] for name in optimizer.hyperparameters()},
        )
        new_step = jax.lax.with_sharding_constraint(jnp.full(step.shape, slots[STEP], step.dtype), sharded)
        return (table, *(slots[name] for name in slot_args), new_step, workspace)


_registry: dict[str, StackComputation] = {}
_by_layout: dict[tuple, StackComputation] = {}
_registry_lock = threading.Lock()


def register_stack(engine: SparseCoreEmbedding, stack: str) -> StackComputation:
    """The computation of a stack of `engine`: registered under a new `computation_name`, or the
    one already registered for the same layout on the same devices (whose engine computes the
    same thing, so its compiled programs are shared)."""
    layout = (engine.stacks[stack], engine.topology, tuple(engine.mesh.devices.flat), engine.axis)
    with _registry_lock:
        computation = _by_layout.get(layout)
        if computation is None:
            computation = StackComputation(f"{stack}#{len(_registry)}", engine, engine.stacks[stack])
            _registry[computation.name] = computation
            _by_layout[layout] = computation
    return computation


def _computation(static: Mapping[str, Any]) -> StackComputation:
    name = static["computation_name"]
    computation = _registry.get(name)
    if computation is None:
        raise ValueError(
            f"no SparseCore computation named {name!r} is registered (was its module deleted?); "
            f"registered: {sorted(_registry)}"
        )
    expected = computation.static_args
    wrong = {key: value for key, value in static.items() if expected[key] != value}
    if wrong:
        raise ValueError(
            f"computation {name!r}: static arguments {wrong} do not match the registered stack's "
            f"{ {key: expected[key] for key in wrong} }"
        )
    return computation


def _op_function(name: str, tensors: tuple[str, ...], body) -> Any:
    """A function `f(*tensors, *, <static args>)` with that signature, for `jax_kernel`."""

    def op(*arrays: jax.Array, **static: Any) -> Any:
        return body(_computation(static), dict(zip(tensors, arrays)))

    op.__name__ = name
    op.__signature__ = inspect.Signature(
        [inspect.Parameter(t, inspect.Parameter.POSITIONAL_ONLY) for t in tensors] + list(_STATIC)
    )
    return op


sparse_dense_matmul: JaxKernel = jax_kernel("tpu::sparse_dense_matmul")(
    _op_function(
        "sparse_dense_matmul",
        (*_LOOKUP_BUFFERS, "embedding_table"),
        lambda computation, values: computation.lookup(values),
    )
)
"""`(row_pointers, embedding_ids, sample_ids, gains, embedding_table, *, batch_size,
max_ids_per_partition, max_unique_ids_per_partition, computation_name) -> activations`: the
stack's activations `[N * B, D]`, SparseCore-major (`SparseCoreEmbedding.lookup_stack`)."""


def _update_op(optimizer_class: type[OptimizerSpec]) -> JaxKernel:
    hyperparameters = ("learning_rate", *optimizer_class.HYPERPARAMETERS, CLIP)
    slot_args = {
        slot.name: f"{slot.name}_slot" if slot.name in hyperparameters else slot.name
        for slot in optimizer_class().slots()
    }
    tensors = (
        *BUFFERS, "embedding_table", *slot_args.values(), "step", "activations_grad", *hyperparameters,
        "gradient_workspace",
    )

    def body(computation: StackComputation, values: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        if type(computation.optimizer) is not optimizer_class:
            raise ValueError(
                f"computation {computation.name!r} updates with {type(computation.optimizer).__name__}, "
                f"not {optimizer_class.__name__}"
            )
        return computation.update(values, slot_args)

    name = f"sparse_dense_matmul_grad_with_{optimizer_class.NAME}"
    written = ("embedding_table", *slot_args.values(), "step", "gradient_workspace")
    return jax_kernel(f"tpu::{name}", num_outputs=len(written), mutates=written)(_op_function(name, tensors, body))


UPDATE_KERNELS: dict[str, JaxKernel] = {name: _update_op(cls) for name, cls in OPTIMIZERS.items()}
"""`torch.ops.tpu.sparse_dense_matmul_grad_with_<name>` by optimizer name: `(*BUFFERS,
embedding_table, *slots, step, activations_grad, learning_rate, *hyper-parameters, clip_gradient,
gradient_workspace, *, <static>) -> (embedding_table, *slots, step, gradient_workspace)`; slots and
hyper-parameters in the order of the optimizer spec (`slots()`, `HYPERPARAMETERS`; a slot named
like a hyper-parameter is passed as `<name>_slot`), `step` a `[devices]` float32 update count,
`gradient_workspace` the stand-in's zeroed scratch (see the module docstring). Each has an in-place
form (`.inplace(...)`, the op `..._grad_with_<name>_`) writing table, slots, step and workspace
where they are."""


def update_kernel(optimizer: OptimizerSpec) -> JaxKernel:
    """The update op for `optimizer`'s class."""
    return UPDATE_KERNELS[type(optimizer).NAME]
