"""The XLA transport: tpu_dist collectives as XLA programs across TPU chips.

Only a TPU takes this path by default (`on_tpu()`, the one switch, read by
`process_group._transport`), and there is no TPU on the development machines: it has never run
on TPU hardware. It is tested on the CPU stand-in instead (`TORCHTPU_DIST_TRANSPORT=xla`), where
JAX's multi-process runtime runs the same XLA collectives over gloo; what stays untested is what
only a TPU has (ICI/DCN collectives, one chip per process, the TPU chip scan in `on_tpu`).

Set-up. Collectives between processes need JAX's multi-controller runtime, which must start
before the TPU backend does: the first tpu_dist group (the default group, created by
`init_process_group`) configures the runtime to join it (`runtime.configure_distributed`), with
the coordinator address that rank 0 publishes through torch's store, so any launcher that gives
torch a store works (the runtime raises a clear error if it already started on its own).

A collective stacks this process's value into a global array over the mesh of every rank's
device (`jax.make_array_from_single_device_arrays`), runs the program, and copies this process's
row of the result into the output tensor through the executor (so views, in-place semantics and
DeferAndFuse stay right). XLA runs asynchronously; waiting on the Work blocks until the results
exist. Point-to-point send/recv go through the host transport (gloo over host memory).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from torchtpu import dtypes, runtime, storage
from torchtpu.distributed import xla_collectives as programs
from torchtpu.distributed.checks import ExchangeSizes
from torchtpu.distributed.host_transport import HostTransport
from torchtpu.distributed.pairwise import Pairwise
from torchtpu.distributed.work import TpuWork
from torchtpu.exec import memory

Tensors = Sequence[torch.Tensor]

_REDUCE_OPS = (
    (dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.PRODUCT, "product"), (dist.ReduceOp.BAND, "band"),
    (dist.ReduceOp.BOR, "bor"), (dist.ReduceOp.BXOR, "bxor"),
)


def on_tpu() -> bool:
    """True on a TPU host. Decided without starting the runtime when it has not started yet
    (JAX's own scan for TPU chips), so that the multi-controller runtime can still start first."""
    if runtime.is_started():
        return runtime.runtime().on_tpu
    from jax._src import hardware_utils

    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    return chips > 0


def _op_name(op: dist.ReduceOp) -> str:
    for reduce_op, name in _REDUCE_OPS:
        if op == reduce_op:
            return name
    raise ValueError(f"tpu_dist: reduce op {op} is not supported on TPU")


class XlaTransport:
    """c10d collectives on tpu tensors as XLA collectives across the ranks' devices."""

    def __init__(self, gloo: dist.ProcessGroupGloo, pairwise: Pairwise, store: dist.Store, rank: int,
                 size: int) -> None:
        if not dist.is_initialized():  # the default group, being created by init_process_group
            runtime.configure_distributed_from_store(store, rank, size, key="xla/coordinator")
        self._gloo = gloo
        self._rank = rank
        self._size = size
        self._host = HostTransport(gloo, pairwise, rank)
        self._mesh = None

    # --- plumbing ---------------------------------------------------------------------------

    def _mesh_for(self, t: torch.Tensor):
        """The mesh of every rank's device, in rank order (gathered once, over gloo)."""
        if self._mesh is None:
            import jax
            from jax.sharding import Mesh

            mine = torch.tensor([runtime.jax_device(t.device.index).id], dtype=torch.int64)
            ids = torch.empty(self._size, dtype=torch.int64)
            self._gloo._allgather_base(ids, mine).wait()
            by_id = {d.id: d for d in jax.devices()}
            self._mesh = Mesh(np.array([by_id[i] for i in ids.tolist()]), (programs.AXIS,))
        return self._mesh

    def _stacked(self, mesh, value):
        """The global `[world, ...]` array whose row `rank` is this process's `value` (placed on
        this rank's device: JAX may leave results of empty arrays on its default device)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = NamedSharding(mesh, PartitionSpec(programs.AXIS))
        row = self._on_device(mesh, value[None])
        return jax.make_array_from_single_device_arrays((self._size, *value.shape), sharding, [row])

    @staticmethod
    def _mine(stacked):
        return stacked.addressable_shards[0].data[0]

    @staticmethod
    def _write(dst: torch.Tensor, value) -> None:
        flat = value.reshape(-1)
        buffer = storage.DeviceBuffer(dst.dtype, flat.shape[0], dst.device.index, flat)
        dst.copy_(storage.new_tensor(buffer, tuple(dst.shape)))

    def _done(self, collective: str, results: list, outputs: Tensors) -> TpuWork:
        def complete(timeout: timedelta | None) -> None:
            import jax

            jax.block_until_ready(results)

        return TpuWork(collective, self._rank, complete, outputs)

    def _on_device(self, mesh, array):
        import jax

        return jax.device_put(array, mesh.devices.flat[self._rank])

    # --- collectives ------------------------------------------------------------------------

    def _all_reduce(self, collective: str, tensors: Tensors, opts, writes: bool) -> TpuWork:
        """Every rank's tensors reduced (`opts.reduceOp`); written into this rank's if `writes`."""
        op = _op_name(opts.reduceOp)
        results = []
        for t in tensors:
            value = memory.to_array(t)
            programs.check_reduce_op(op, value.dtype)
            mesh = self._mesh_for(t)
            out = self._mine(programs.all_reduce(mesh, op)(self._stacked(mesh, value)))
            if writes:
                self._write(t, out)
            results.append(out)
        return self._done(collective, results, tensors)

    def allreduce(self, tensors: Tensors, opts: dist.AllreduceOptions) -> TpuWork:
        return self._all_reduce("all_reduce", tensors, opts, writes=True)

    def allreduce_coalesced(self, tensors: Tensors, opts: dist.AllreduceCoalescedOptions) -> TpuWork:
        return self._all_reduce("all_reduce_coalesced", tensors, opts, writes=True)

    def reduce(self, tensors: Tensors, opts: dist.ReduceOptions) -> TpuWork:
        """An all-reduce that only the root writes: the other ranks' tensors keep their values."""
        return self._all_reduce("reduce", tensors, opts, writes=self._rank == opts.rootRank)

    def broadcast(self, tensors: Tensors, opts: dist.BroadcastOptions) -> TpuWork:
        source = tensors[opts.rootTensor] if self._rank == opts.rootRank else None
        results = []
        for t in tensors:
            out = self._broadcast(t, memory.to_array(source if source is not None else t), opts.rootRank)
            self._write(t, out)
            results.append(out)
        return self._done("broadcast", results, tensors)

    def _broadcast(self, t: torch.Tensor, value, root: int):
        """The root rank's `value` (every rank passes one of the same shape and dtype)."""
        mesh = self._mesh_for(t)
        return self._mine(programs.broadcast(mesh, root)(self._stacked(mesh, value)))

    def scatter(self, outputs: Tensors, inputs: Sequence[Tensors], opts: dist.ScatterOptions) -> TpuWork:
        """The root's tensors, stacked and broadcast; each rank writes its own row. This moves
        the world size times the bytes a scatter needs: scatters are rare (set-up, not steps)."""
        import jax.numpy as jnp

        (output,) = outputs
        if self._rank == opts.rootRank:
            stacked = jnp.stack([memory.to_array(t) for t in inputs[0]])
        else:
            stacked = jnp.zeros((self._size, *output.shape), dtypes.to_jax(output.dtype))
        rows = self._broadcast(output, stacked, opts.rootRank)
        self._write(output, rows[self._rank])
        return self._done("scatter", [rows], outputs)

    def _gathered(self, input: torch.Tensor):
        """Every rank's `input`, stacked in rank order."""
        mesh = self._mesh_for(input)
        return self._mine(programs.all_gather(mesh)(self._stacked(mesh, memory.to_array(input))))

    def allgather(self, outputs: Sequence[Tensors], inputs: Tensors, opts: dist.AllgatherOptions) -> TpuWork:
        results = []
        for group, input in zip(outputs, inputs):
            rows = self._gathered(input)
            for j, out in enumerate(group):
                self._write(out, rows[j])
            results.append(rows)
        return self._done("all_gather", results, [t for group in outputs for t in group])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: dist.AllgatherOptions) -> TpuWork:
        rows = self._gathered(input)
        self._write(output, rows)
        return self._done("all_gather_into_tensor", [rows], [output])

    def gather(self, outputs: Sequence[Tensors], inputs: Tensors, opts: dist.GatherOptions) -> TpuWork:
        """An all-gather that only the root writes."""
        rows = self._gathered(inputs[0])
        for group in outputs:  # the root's one list; none elsewhere
            for j, out in enumerate(group):
                self._write(out, rows[j])
        return self._done("gather", [rows], [t for group in outputs for t in group])

    def _reduce_scatter(self, output: torch.Tensor, chunks, op: str):
        mesh = self._mesh_for(output)
        programs.check_reduce_op(op, chunks.dtype)
        out = self._mine(programs.reduce_scatter(mesh, op)(self._stacked(mesh, chunks)))
        self._write(output, out)
        return out

    def reduce_scatter(self, outputs: Tensors, inputs: Sequence[Tensors], opts: dist.ReduceScatterOptions) -> TpuWork:
        import jax.numpy as jnp

        op = _op_name(opts.reduceOp)
        results = [
            self._reduce_scatter(output, jnp.stack([memory.to_array(t) for t in group]), op)
            for output, group in zip(outputs, inputs)
        ]
        return self._done("reduce_scatter", results, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: dist.ReduceScatterOptions) -> TpuWork:
        chunks = memory.to_array(input).reshape(self._size, -1)
        out = self._reduce_scatter(output, chunks, _op_name(opts.reduceOp))
        return self._done("reduce_scatter_tensor", [out], [output])

    def _ragged(self, t: torch.Tensor, flat, sizes: ExchangeSizes):
        """This rank's received rows (flattened) of an uneven all-to-all of `flat`'s rows."""
        import jax.numpy as jnp

        mesh = self._mesh_for(t)
        sends, row = sizes.send, sizes.row_numel
        rows_in = programs.bucket(sends.sum(axis=1).max())
        rows_out = programs.bucket(sends.sum(axis=0).max())
        block = programs.bucket(sends.max())
        mine = flat.reshape(-1, row)
        mine = jnp.pad(mine, ((0, rows_in - mine.shape[0]), (0, 0)))
        send, recv = programs.ragged_indices(sends, self._rank, block, rows_out)
        args = [self._stacked(mesh, a) for a in (mine, send, recv)]
        received = self._mine(programs.ragged_all_to_all(mesh)(*args))
        return received[: int(sends[:, self._rank].sum())].reshape(-1)

    def stage_all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                                sizes: ExchangeSizes) -> Callable[[], TpuWork]:
        """What runs the all-to-all (XLA stages nothing ahead: the program runs when started)."""
        return functools.partial(self._all_to_all_single, output, input, sizes)

    def _all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, sizes: ExchangeSizes) -> TpuWork:
        if sizes.row_numel == 0:
            return self._done("all_to_all_single", [], [output])
        out = self._ragged(input, memory.to_array(input), sizes)
        self._write(output, out)
        return self._done("all_to_all_single", [out], [output])

    def alltoall(self, outputs: Tensors, inputs: Tensors, sizes: ExchangeSizes) -> TpuWork:
        import jax.numpy as jnp

        flat = jnp.concatenate([memory.to_array(t) for t in inputs])
        out = self._ragged(inputs[0], flat, sizes)
        offsets = np.cumsum([0] + [t.numel() for t in outputs])
        for t, start, stop in zip(outputs, offsets[:-1], offsets[1:]):
            self._write(t, out[start:stop])
        return self._done("all_to_all", [out], outputs)

    def send(self, tensors: Tensors, dst: int, tag: int) -> TpuWork:
        return self._host.send(tensors, dst, tag)

    def recv(self, tensors: Tensors, src: int, tag: int) -> TpuWork:
        return self._host.recv(tensors, src, tag)

    def recv_anysource(self, tensors: Tensors, tag: int) -> TpuWork:
        return self._host.recv_anysource(tensors, tag)
