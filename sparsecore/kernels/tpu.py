"""The kernels on a real TPU: XLA custom calls served by libtpu's SparseCore runtime.

UNTESTED ON HARDWARE: there is no TPU here. The tests only check that these primitives lower, for
the "tpu" platform, to the custom calls below with the operands, backend config and called
computation of the contract jax-tpu-embedding uses; whether libtpu accepts them is unverified.
They are selected by `sparsecore.kernels.local_kernels("tpu")` only, never on CPU (where
libtpu's targets are not registered).

* ``SparseDenseMatmulOp(row_pointers, embedding_ids, sample_ids, gains, table, zeros[S*B, D])``
  -> activations ``[S*B, D]``;
* ``SparseDenseMatmulGradOpWithOptimizerUpdate(row_pointers, embedding_ids, sample_ids, gains,
  activation_grads, table, slots..., hyper-parameters...)`` -> ``(table, slots...)``, with the
  optimizer as a called computation applied per row on ``[1, D]`` values:
  ``(grad, row, slots..., hyper-parameters...) -> tuple(row, slots...)``. It is lowered from the
  same `OptimizerSpec.update_rows` body the stand-in uses, so both paths share one definition.

The SparseCores run their own all-to-all, so these per-device calls take no collectives; the
unique-row side-car and the workspace of the stand-in are unused here. Slots must be shaped like
the table (the custom call's contract); a per-row ``[rows, 1]`` slot (`RowWiseAdagrad`) is
rejected with a `ValueError` instead of being silently widened.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo

from sparsecore.kernels.geometry import KernelGeometry
from sparsecore.optimizers import STEP, OptimizerSpec
from sparsecore.preprocess import PAD_ID

Array = jax.Array

MOD_SHARDING = 1
"""`sharding_strategy` value of MOD sharding in the custom calls' config."""

LOOKUP_TARGET = "SparseDenseMatmulOp"
UPDATE_TARGET = "SparseDenseMatmulGradOpWithOptimizerUpdate"


def backend_config(geometry: KernelGeometry, **extra: int) -> str:
    """The JSON `backend_config` both custom calls carry."""
    config = {
        "max_ids_per_partition": geometry.max_ids_per_partition,
        "max_unique_ids_per_partition": geometry.max_unique_ids_per_partition,
        "pad_value": PAD_ID,
        "sharding_strategy": MOD_SHARDING,
        **extra,
    }
    return json.dumps({"sparse_dense_matmul_config": config, "device_type": "DEVICE_TYPE_SPARSECORE"})


def _mark_sparse(op: ir.Operation) -> None:
    op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get({"_xla_compute_type": ir.StringAttr.get("sparse")})


def _like(aval: jax.core.ShapedArray, shape: tuple[int, ...]) -> jax.core.ShapedArray:
    """A float32 result of `shape` that varies over the same mesh axes as the 2-D `aval`."""
    return aval.update(shape=shape, dtype=jnp.dtype(jnp.float32), weak_type=False)


def _check_buffers(row_pointers, embedding_ids, sample_ids, gains) -> None:
    for name, aval, dtype in (
        ("row_pointers", row_pointers, jnp.int32),
        ("embedding_ids", embedding_ids, jnp.int32),
        ("sample_ids", sample_ids, jnp.int32),
        ("gains", gains, jnp.float32),
    ):
        if aval.dtype != dtype or aval.ndim != 1:
            raise ValueError(f"{name} must be a 1-D {jnp.dtype(dtype).name} array, got {aval.dtype}{list(aval.shape)}")
    if not embedding_ids.shape == sample_ids.shape == gains.shape:
        raise ValueError(
            f"embedding_ids, sample_ids and gains must have one length, got "
            f"{embedding_ids.shape}, {sample_ids.shape}, {gains.shape}"
        )


# ----------------------------------------------------------------------------- lookup

sparse_dense_matmul_p = jex.core.Primitive("sparsecore_sparse_dense_matmul")


def _lookup_abstract_eval(row_pointers, embedding_ids, sample_ids, gains, table, activations, *, geometry):
    _check_buffers(row_pointers, embedding_ids, sample_ids, gains)
    if table.shape != (geometry.rows_per_device, geometry.embedding_dim) or table.dtype != jnp.float32:
        raise ValueError(
            f"table must be float32[{geometry.rows_per_device}, {geometry.embedding_dim}], got {table.dtype}{list(table.shape)}"
        )
    if activations.shape != (geometry.samples_per_device, geometry.embedding_dim):
        raise ValueError(f"activations must be [{geometry.samples_per_device}, {geometry.embedding_dim}]")
    return _like(table, activations.shape)


def _lookup_lowering(ctx, row_pointers, embedding_ids, sample_ids, gains, table, activations, *, geometry):
    return jax.ffi.ffi_lowering(
        LOOKUP_TARGET,
        backend_config=backend_config(geometry),
        skip_ffi_layout_processing=True,
        api_version=1,
    )(ctx, row_pointers, embedding_ids, sample_ids, gains, table, activations)


sparse_dense_matmul_p.def_abstract_eval(_lookup_abstract_eval)
mlir.register_lowering(sparse_dense_matmul_p, _lookup_lowering, platform="tpu")


def lookup_local(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    table: Array,
    *,
    geometry: KernelGeometry,
    axis_name: str,
) -> Array:
    """One device's lookup through `SparseDenseMatmulOp` (signature of the stand-in's)."""
    del axis_name
    zeros = jnp.zeros((geometry.samples_per_device, table.shape[1]), jnp.float32)
    return sparse_dense_matmul_p.bind(row_pointers, embedding_ids, sample_ids, gains, table, zeros, geometry=geometry)


# ----------------------------------------------------------------------------- update

sparse_dense_matmul_grad_p = jex.core.Primitive("sparsecore_sparse_dense_matmul_grad_with_optimizer")
sparse_dense_matmul_grad_p.multiple_results = True


def _update_abstract_eval(
    row_pointers, embedding_ids, sample_ids, gains, activation_grads, table, *rest, geometry, optimizer, slot_names
):
    _check_buffers(row_pointers, embedding_ids, sample_ids, gains)
    slots = rest[: len(slot_names)]
    for name, aval in zip(("table", *slot_names), (table, *slots)):
        if aval.shape != table.shape or aval.dtype != jnp.float32:
            raise ValueError(
                f"{type(optimizer).__name__} on TPU: {name} must be float32{list(table.shape)} like the "
                f"table (the custom call updates slot variables shaped like the table), got "
                f"{aval.dtype}{list(aval.shape)}"
            )
    if activation_grads.shape != (geometry.samples_per_device, table.shape[1]):
        raise ValueError(
            f"activation_grads must be [{geometry.samples_per_device}, {table.shape[1]}], got {list(activation_grads.shape)}"
        )
    return [_like(table, table.shape) for _ in (table, *slots)]


def _optimizer_computation(
    ctx, name: str, optimizer: OptimizerSpec, slot_names, hyper_names, dim: int, logical_dim: int
) -> str:
    """Emit the per-row optimizer `(grad, row, slots..., hyper...) -> tuple(row, slots...)` on
    `[1, dim]` values (the table's own `logical_dim` columns first) as a private function of the
    module; returns its symbol name."""
    row = jax.core.ShapedArray((1, dim), jnp.float32)
    row_type = mlir.aval_to_ir_type(ctx.module_context, row)
    arity = 2 + len(slot_names) + len(hyper_names)
    outputs = 1 + len(slot_names)
    result = ir.TupleType.get_tuple([row_type] * outputs)
    function = func_dialect.FuncOp(name, ([row_type] * arity, [result]), ip=ctx.module_context.ip, visibility="private")
    block = function.add_entry_block()

    def body(grad, current, *rest):
        slots = dict(zip(slot_names, rest[: len(slot_names)]))
        hyper = dict(zip(hyper_names, rest[len(slot_names) :]))
        new_row, new_slots = optimizer.update_rows(grad, current, slots, hyper, dim=logical_dim)
        return [new_row, *(new_slots[s] for s in slot_names)]

    with ir.InsertionPoint(block):
        inner = ctx.replace(avals_in=[row] * arity, avals_out=[row] * outputs, tokens_in=None, tokens_out=None)
        values = mlir.lower_fun(body, multiple_results=True)(inner, *block.arguments)
        flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]
        func_dialect.ReturnOp([hlo.tuple(flat)])
    return ir.StringAttr(function.attributes["sym_name"]).value


def _update_lowering(
    ctx, row_pointers, embedding_ids, sample_ids, gains, activation_grads, table, *rest, geometry, optimizer, slot_names
):
    hyper_names = (*optimizer.hyperparameters(), STEP)
    computation = _optimizer_computation(
        ctx,
        f"{geometry.name}_optimizer_update",
        optimizer,
        slot_names,
        hyper_names,
        geometry.embedding_dim,
        geometry.logical_embedding_dim,
    )
    result = ir.TupleType.get_tuple([mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out])
    config = backend_config(geometry, num_slot_variables=len(slot_names), num_hyperparameters=len(hyper_names))
    call = jax.ffi.ffi_lowering(
        UPDATE_TARGET,
        result_types=[result],
        backend_config=config,
        called_computations=[computation],
        skip_ffi_layout_processing=True,
        api_version=1,
    )(ctx, row_pointers, embedding_ids, sample_ids, gains, activation_grads, table, *rest)
    outputs = []
    for index in range(len(ctx.avals_out)):
        element = hlo.GetTupleElementOp(call[0] if isinstance(call, (list, tuple)) else call, index)
        _mark_sparse(element.operation)
        outputs.append(element.result)
    return outputs


sparse_dense_matmul_grad_p.def_abstract_eval(_update_abstract_eval)
mlir.register_lowering(sparse_dense_matmul_grad_p, _update_lowering, platform="tpu")


def update_local(
    row_pointers: Array,
    embedding_ids: Array,
    sample_ids: Array,
    gains: Array,
    entry_unique_index: Array,
    unique_ids: Array,
    activation_grads: Array,
    table: Array,
    slots: Mapping[str, Array],
    workspace: Array,
    hyperparameters: Mapping[str, Array],
    *,
    geometry: KernelGeometry,
    optimizer: OptimizerSpec,
    axis_name: str,
) -> tuple[Array, dict[str, Array], Array]:
    """One device's fused backward + optimizer through the custom call (signature of the
    stand-in's; side-car and workspace pass through unused)."""
    del entry_unique_index, unique_ids, axis_name
    per_row = [slot.name for slot in optimizer.slots() if slot.per_row]
    if per_row:
        raise ValueError(
            f"{type(optimizer).__name__} keeps per-row slot(s) {per_row} of shape [rows, 1]; "
            f"{UPDATE_TARGET} needs slot variables shaped like the table, so it cannot run on TPU"
        )
    slot_names = tuple(slot.name for slot in optimizer.slots())
    hyper_names = (*optimizer.hyperparameters(), STEP)
    scalars = [jnp.asarray(hyperparameters[name], jnp.float32).reshape(()) for name in hyper_names]
    new_table, *new_slots = sparse_dense_matmul_grad_p.bind(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        activation_grads,
        table,
        *(slots[name] for name in slot_names),
        *scalars,
        geometry=geometry,
        optimizer=optimizer,
        slot_names=slot_names,
    )
    return new_table, dict(zip(slot_names, new_slots)), workspace
