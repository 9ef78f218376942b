"""`ProcessGroupTPU`: the torch.distributed process group behind the `tpu_dist` backend.

A Python `ProcessGroup` (PyTorch's trampoline forwards C++ callers -- DDP's reducer,
`_broadcast_coalesced` -- to these methods too). It checks each call's arguments and routes it:

- `tpu` tensors go to the group's transport. On TPU that is the XLA transport (collectives
  compiled across the chips of a global mesh; never run on a TPU, there is none here, but tested
  on the CPU stand-in's multi-process JAX runtime); everywhere else it is the host transport
  (gloo over host buffers), which is what the CPU stand-in runs by default.
- `cpu` tensors go straight to gloo when the group was created for them
  (`init_process_group("cpu:gloo,tpu:tpu_dist")`); a tpu-only group rejects them.

An all-to-all first agrees with every rank on the sizes each sends each (`exchange`), so
mismatched splits raise the same error everywhere instead of hanging or misdelivering; where all
bytes go through gloo, repeated sizes are guessed, and exchanged only when a rank's call differs
from the guess. The sizes, and the bytes of all-to-alls that go through gloo (of cpu tensors
too), travel as point-to-point messages on gloo groups of their own (`pairwise`).

Both paths share one gloo backend for everything else, built on the group's own store, so the
bytes travel through PyTorch's transport, not a home-made one. One process drives one tpu device:
the group binds to the device of its first tpu collective and rejects tensors on any other.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed import distributed_c10d

from torchtpu.distributed import checks
from torchtpu.distributed.exchange import SizeExchange
from torchtpu.distributed.host_transport import HostTransport
from torchtpu.distributed.pairwise import Pairwise
from torchtpu.distributed.work import TpuWork, WorkList

BACKEND_NAME = "tpu_dist"
TRANSPORT_ENV = "TORCHTPU_DIST_TRANSPORT"

Tensors = Sequence[torch.Tensor]

_SPLITS_REMEMBERED = 256  # checked split sizes of all_to_all_single calls (forgotten all at once)


class ProcessGroupTPU(dist.ProcessGroup):
    """Collectives on `tpu` tensors for torch.distributed (backend name `tpu_dist`)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._group_rank, self._world_size = rank, size  # the C++ getters cost a GIL release a call
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._pairwise = Pairwise(store, rank, size, timeout)
        self._transport = _transport(self._gloo, self._pairwise, store, rank, size)
        # Data moves on guessed sizes only where every rank's bytes go through gloo; the group
        # decides once, so all ranks decide alike (see `exchange`).
        self._sizes = SizeExchange(self._pairwise, rank, size, guesses=isinstance(self._transport, HostTransport))
        self._splits_checked: dict[tuple, tuple[list[int], list[int], tuple[int, ...]]] = {}
        self._device: torch.device | None = None
        self._served: frozenset[str] | None = None
        self._closed = False

    # --- identity ---------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        """The name torch.distributed registered this group under. c10d names the C++ backends it
        wraps, never a Python group that stands for a whole backend, so the C++ property would
        raise "ProcessGroup name not set" (TorchRec's `ShardingEnv` reads it for its DeviceMesh)."""
        return distributed_c10d._world.pg_names[self]

    @property
    def _device_types(self) -> list[torch.device]:
        """Device types this group serves, from its backend config ("tpu", or "cpu" and "tpu").

        PyTorch reads this to pick the device of object collectives and barriers; the C++
        property would report none, since this group registers no C++ backend per device."""
        return [torch.device(d) for d in sorted(self._served_types())]

    def _served_types(self) -> frozenset[str]:
        if self._served is None:
            try:
                config = dist.get_backend_config(self)
            except (ValueError, TypeError):
                return frozenset({"tpu"})  # not registered yet: still being created
            self._served = frozenset(pair.split(":")[0] for pair in config.split(","))
        return self._served

    def shutdown(self) -> None:
        """Refuse further calls and let go of the gloo groups."""
        self._close(c10d.ProcessGroupGloo.shutdown)

    def abort(self) -> None:
        """Refuse further calls and let go of the gloo groups."""
        self._close(c10d.ProcessGroupGloo.abort)

    def _close(self, end: Callable[[c10d.ProcessGroupGloo], None]) -> None:
        """`end` each gloo group, then drop every reference to them: gloo's shutdown and abort
        stop none of its threads or connections, which go when a group is freed (a caller may
        hold this group after `destroy_process_group`, as `dist.group.WORLD` is often held)."""
        if self._closed:
            return
        self._closed = True
        for group in (self._gloo, *self._pairwise.groups):
            end(group)
        del self._gloo, self._pairwise, self._transport, self._sizes

    # --- routing ------------------------------------------------------------------------------

    def _route(self, collective: str, tensors: Tensors):
        """The backend for this call's tensors (all of one device and dtype): gloo for cpu
        tensors, the transport for tpu tensors."""
        if self._closed:
            raise RuntimeError(f"tpu_dist {collective}: this process group was destroyed")
        if self._device is not None and tensors:  # the usual call, checked in one pass
            device, dtype = self._device, tensors[0].dtype
            if all(t.device == device and t.dtype == dtype for t in tensors):
                return self._transport
        device = checks.placement(collective, tensors, "cpu" in self._served_types())
        checks.same_dtype(collective, tensors)
        if device.type == "cpu":
            return self._gloo
        if self._device is None:
            self._device = device
        elif device != self._device:
            raise RuntimeError(
                f"tpu_dist {collective}: tensors are on {device}, but this process drives "
                f"{self._device} in this group (one process per device: call "
                f"torch.tpu.set_device(local_rank) before creating tensors)"
            )
        return self._transport

    # --- collectives (c10d names and arguments) ---------------------------------------------

    def allreduce(self, tensors: Tensors, opts: c10d.AllreduceOptions | None = None) -> dist.Work:
        backend = self._route("all_reduce", tensors)
        return backend.allreduce(tensors, opts or c10d.AllreduceOptions())

    def allreduce_coalesced(self, tensors: Tensors, opts: c10d.AllreduceCoalescedOptions | None = None) -> dist.Work:
        """All-reduces of several tensors of one dtype as one call (`_coalescing_manager`'s)."""
        backend = self._route("all_reduce_coalesced", tensors)
        return backend.allreduce_coalesced(tensors, opts or c10d.AllreduceCoalescedOptions())

    def reduce(self, tensors: Tensors, opts: c10d.ReduceOptions | None = None) -> dist.Work:
        """The reduction lands on the root rank; every other rank's tensor keeps its value."""
        opts = opts or c10d.ReduceOptions()
        backend = self._route("reduce", tensors)
        checks.single("reduce", "tensors", tensors)
        checks.root_rank("reduce", opts.rootRank, self._world_size)
        return backend.reduce(tensors, opts)

    def broadcast(self, tensors: Tensors, opts: c10d.BroadcastOptions | None = None) -> dist.Work:
        opts = opts or c10d.BroadcastOptions()
        backend = self._route("broadcast", tensors)
        checks.root_rank("broadcast", opts.rootRank, self._world_size)
        return backend.broadcast(tensors, opts)

    def allgather(self, output_tensors: Sequence[Tensors], input_tensors: Tensors,
                  opts: c10d.AllgatherOptions | None = None) -> dist.Work:
        c = "all_gather"
        backend = self._route(c, [*(t for group in output_tensors for t in group), *input_tensors])
        checks.one_per_rank(c, "tensor_list", output_tensors, input_tensors, "tensor", self._world_size)
        return backend.allgather(output_tensors, input_tensors, opts or c10d.AllgatherOptions())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: c10d.AllgatherOptions | None = None) -> dist.Work:
        c = "all_gather_into_tensor"
        backend = self._route(c, [output, input])
        checks.world_multiple(c, output, "output_tensor", input, "input_tensor", self._world_size)
        return _single_tensor(backend, "all_gather_single")(output, input, opts or c10d.AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, output_tensors: Tensors, input_tensors: Tensors,
                                    opts: c10d.AllgatherOptions | None = None) -> dist.Work:
        """All-gathers into tensors, several as one call (`_coalescing_manager`'s)."""
        return self._coalesced("all_gather_into_tensor_coalesced", "all_gather_single", output_tensors,
                               input_tensors, opts or c10d.AllgatherOptions(), gathers=True)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: Sequence[Tensors], input_tensors: Tensors,
               opts: c10d.GatherOptions | None = None) -> dist.Work:
        c = "gather"
        opts = opts or c10d.GatherOptions()
        backend = self._route(c, [*(t for group in output_tensors for t in group), *input_tensors])
        checks.single(c, "input_tensors", input_tensors)
        checks.root_rank(c, opts.rootRank, self._world_size)
        checks.rooted_lists(c, "output_tensors", output_tensors, input_tensors[0], "the input",
                            self._group_rank == opts.rootRank, self._world_size)
        return backend.gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors: Tensors, input_tensors: Sequence[Tensors],
                opts: c10d.ScatterOptions | None = None) -> dist.Work:
        c = "scatter"
        opts = opts or c10d.ScatterOptions()
        backend = self._route(c, [*output_tensors, *(t for group in input_tensors for t in group)])
        checks.single(c, "output_tensors", output_tensors)
        checks.root_rank(c, opts.rootRank, self._world_size)
        checks.rooted_lists(c, "input_tensors", input_tensors, output_tensors[0], "the output",
                            self._group_rank == opts.rootRank, self._world_size)
        return backend.scatter(output_tensors, input_tensors, opts)

    def reduce_scatter(self, output_tensors: Tensors, input_tensors: Sequence[Tensors],
                       opts: c10d.ReduceScatterOptions | None = None) -> dist.Work:
        c = "reduce_scatter"
        backend = self._route(c, [*output_tensors, *(t for group in input_tensors for t in group)])
        checks.one_per_rank(c, "input_list", input_tensors, output_tensors, "output", self._world_size)
        return backend.reduce_scatter(output_tensors, input_tensors, opts or c10d.ReduceScatterOptions())

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: c10d.ReduceScatterOptions | None = None) -> dist.Work:
        c = "reduce_scatter_tensor"
        backend = self._route(c, [output, input])
        checks.world_multiple(c, input, "input", output, "output", self._world_size)
        return _single_tensor(backend, "reduce_scatter_single")(output, input, opts or c10d.ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, output_tensors: Tensors, input_tensors: Tensors,
                                        opts: c10d.ReduceScatterOptions | None = None) -> dist.Work:
        """Reduce-scatters of tensors, several as one call (`_coalescing_manager`'s)."""
        return self._coalesced("reduce_scatter_tensor_coalesced", "reduce_scatter_single", output_tensors,
                               input_tensors, opts or c10d.ReduceScatterOptions(), gathers=False)

    def _coalesced(self, collective: str, single: str, output_tensors: Tensors, input_tensors: Tensors, opts,
                   gathers: bool) -> dist.Work:
        """The single-tensor collective `single` of each output and input in turn, waited on as
        one work. Where the call `gathers`, each output holds its input once per rank; else each
        input holds its output once per rank."""
        c = collective
        backend = self._route(c, [*output_tensors, *input_tensors])
        checks.same_count(c, "output_tensors", output_tensors, "input_tensors", input_tensors)
        for output, input in zip(output_tensors, input_tensors):
            if gathers:
                checks.world_multiple(c, output, "an output tensor", input, "its input tensor", self._world_size)
            else:
                checks.world_multiple(c, input, "an input tensor", output, "its output tensor", self._world_size)
        run = _single_tensor(backend, single)
        works = [run(output, input, opts) for output, input in zip(output_tensors, input_tensors)]
        return TpuWork(c, self._group_rank, WorkList(works).wait, output_tensors)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: c10d.AllToAllOptions | None = None) -> dist.Work:
        c = "all_to_all_single"
        backend = self._route(c, [output, input])
        # c10d ignores the row shape of a side without rows: TorchRec's sequence all-to-all sends
        # `[0, dim]` from a rank that holds no table into a flat output.
        if input.shape[0] == 0 and output.dim() > 0:
            input = input.reshape(0, *output.shape[1:])
        elif output.shape[0] == 0 and input.dim() > 0:
            output = output.reshape(0, *input.shape[1:])
        if backend is self._gloo:
            checks.contiguous(c, [output, input])
        send, recv, row = self._checked_splits(output, input, output_split_sizes, input_split_sizes)

        def stage(sizes: checks.ExchangeSizes) -> Callable[[], dist.Work]:
            if backend is self._gloo:
                return functools.partial(self._exchange_on_host, c, output.split(recv), input.split(send), [output])
            return backend.stage_all_to_all_single(output, input, sizes)

        return self._sizes.all_to_all(c, row, stage, "rows", "input_split_sizes", "output_split_sizes")

    alltoall_base = all_to_all_single

    def _checked_splits(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                        input_split_sizes: Sequence[int]) -> tuple[list[int], list[int], tuple[int, ...]]:
        """An all_to_all_single's split sizes, checked against its tensors' shapes: the input's and
        the output's rows per rank, and this rank's `checks.exchange_values`. Remembered per
        shapes, dtype and splits, as repeated calls (every training step's) pass the same ones."""
        key = (output.shape, input.shape, input.dtype, tuple(output_split_sizes), tuple(input_split_sizes))
        checked = self._splits_checked.get(key)
        if checked is None:
            c = "all_to_all_single"
            checks.row_shapes(c, output, input)
            send = checks.split_sizes(c, "input_split_sizes", input, "input", input_split_sizes, self._world_size)
            recv = checks.split_sizes(c, "output_split_sizes", output, "output", output_split_sizes, self._world_size)
            checked = send, recv, checks.exchange_values(send, recv, checks.row_numel(input), input.dtype)
            if len(self._splits_checked) >= _SPLITS_REMEMBERED:
                self._splits_checked.clear()
            self._splits_checked[key] = checked
        return checked

    def alltoall(self, output_tensors: Tensors, input_tensors: Tensors,
                 opts: c10d.AllToAllOptions | None = None) -> dist.Work:
        c = "all_to_all"
        backend = self._route(c, [*output_tensors, *input_tensors])
        checks.list_length(c, "output_tensor_list", output_tensors, self._world_size)
        checks.list_length(c, "input_tensor_list", input_tensors, self._world_size)
        if backend is self._gloo:
            checks.contiguous(c, [*output_tensors, *input_tensors])
        row = checks.exchange_values([t.numel() for t in input_tensors], [t.numel() for t in output_tensors], 1,
                                     input_tensors[0].dtype)
        sizes = self._sizes.agree(c, row, "elements", "input_tensor_list", "output_tensor_list")
        if backend is not self._gloo:
            return backend.alltoall(output_tensors, input_tensors, sizes)
        return self._exchange_on_host(c, output_tensors, input_tensors, output_tensors)

    def _exchange_on_host(self, collective: str, outputs: Tensors, inputs: Tensors, result: Tensors) -> dist.Work:
        """An all-to-all of cpu tensors, of agreed sizes: each rank's piece straight from and into
        the caller's memory (see `pairwise`)."""
        work = self._pairwise.exchange(outputs, inputs)
        return TpuWork(collective, self._group_rank, lambda timeout: work.wait(timeout), result)

    def barrier(self, opts: c10d.BarrierOptions | None = None) -> dist.Work:
        if self._closed:
            raise RuntimeError("tpu_dist barrier: this process group was destroyed")
        return self._gloo.barrier(opts or c10d.BarrierOptions())

    def send(self, tensors: Tensors, dstRank: int, tag: int) -> dist.Work:
        backend = self._route("send", tensors)
        checks.root_rank("send", dstRank, self._world_size)
        return backend.send(tensors, dstRank, tag)

    def recv(self, tensors: Tensors, srcRank: int, tag: int) -> dist.Work:
        backend = self._route("recv", tensors)
        checks.root_rank("recv", srcRank, self._world_size)
        return backend.recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: Tensors, tag: int) -> dist.Work:
        return self._route("recv", tensors).recv_anysource(tensors, tag)


def _transport(gloo: dist.ProcessGroupGloo, pairwise: Pairwise, store: dist.Store, rank: int, size: int):
    """The one switch: XLA collectives on TPU, gloo over host buffers everywhere else.

    `TORCHTPU_DIST_TRANSPORT=xla` (or `host`) overrides it: the tests run the XLA transport on
    the CPU stand-in, whose multi-process JAX runtime runs XLA collectives over gloo."""
    from torchtpu.distributed import xla_transport

    choice = os.environ.get(TRANSPORT_ENV) or ("xla" if xla_transport.on_tpu() else "host")
    if choice == "xla":
        return xla_transport.XlaTransport(gloo, pairwise, store, rank, size)
    if choice == "host":
        return HostTransport(gloo, pairwise, rank)
    raise ValueError(f"{TRANSPORT_ENV}={choice!r}: expected 'xla' or 'host'")


_GLOO_SINGLE_TENSOR = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base"}


def _single_tensor(backend, name: str):
    """`backend`'s single-tensor collective `name`: gloo's Python binding has these only under
    their older names (`_allgather_base`, `_reduce_scatter_base`)."""
    if isinstance(backend, c10d.ProcessGroupGloo):
        return getattr(backend, _GLOO_SINGLE_TENSOR[name])
    return getattr(backend, name)


def create_process_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ProcessGroupTPU:
    """The creator registered with `dist.Backend.register_backend` for `tpu_dist`."""
    return ProcessGroupTPU(store, rank, size, timeout)
