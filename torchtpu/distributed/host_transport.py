"""The host transport: collectives on `tpu` tensors run by gloo over host buffers.

This is the transport of the CPU stand-in (and of point-to-point traffic on TPU). Each call reads
its tpu inputs as host tensors, launches gloo on them and, when the work is waited on, the tpu
outputs hold gloo's results. Where device memory is host memory (JAX's CPU platform) no byte is
copied on our side:

- an input is a read-only view of its device buffer;
- an output that covers its storage and whose buffer nothing else holds is *claimed*: its
  buffer is donated to JAX (which waits for every pending reader of it), and gloo writes the
  result into the donated memory, which stays the output's buffer -- in place, as gloo does with
  CPU tensors. This is how all_reduce runs without a copy (counted by `torchtpu.metrics()` as
  `dist_buffers_claimed`).
- any other output that covers its storage receives into a pooled device array that nothing
  else holds, claimed as above, which then becomes its buffer (`ResultArrays`). So does a fresh
  `torch.empty` output (what TorchRec's all-to-alls write into every step): it has no device
  buffer yet, and reading it would make one of zeros only to replace it. An output that is a
  view receives into a pooled host buffer that is then copied into it. An all_reduce of a tensor
  it cannot claim copies its value into that memory first, since device buffers are immutable.

All-to-alls move as point-to-point messages (`pairwise`), each peer's region straight from the
input's memory into the output's.

Where a call's time goes, and what was tried to shorten it: `docs/tpu_dist-performance.md`.

On other platforms the same code moves data device -> host -> device. Gloo only reads the
buffers passed as inputs here; the tests check that inputs are unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import weakref
from collections import OrderedDict
from datetime import timedelta
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from torchtpu import counters, runtime, storage
from torchtpu.distributed.checks import ExchangeSizes
from torchtpu.distributed.pairwise import Pairwise, copy_bytes
from torchtpu.distributed.work import TpuWork, WorkList
from torchtpu.exec import memory

Tensors = Sequence[torch.Tensor]


def host_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with `t`'s value; a view of its device memory where that is host
    memory (treat it as read-only: device buffers are immutable)."""
    array = memory.to_array(t)
    if runtime.runtime().device_memory_is_host:
        return _host_memory(array, t.shape)
    return memory.numpy_to_torch(np.asarray(array)).view(t.shape)


def _host_memory(array, shape: torch.Size) -> torch.Tensor:
    """A CPU tensor of `shape` over the memory of a flat CPU-platform `jax.Array`, once ready.

    This is `array.__dlpack__()` without the Python around the one runtime call (~25 us a call
    against ~3). Like `__dlpack__`, it exports a new array object over the same buffer, not
    `array` itself: the export's reference to the object it was given is dropped only when the
    runtime next collects its garbage, and a host view must leave the reference count of the
    storage's own array alone (`claim` reads it)."""
    single = _single_buffer(array)
    if single is None:  # spread over devices: jax's own export raises why
        return torch._C._from_dlpack(array.__dlpack__())
    return _over(single, shape)


def _single_buffer(array):
    """The CPU-platform `array`'s buffer as a single-device array; None when the array is spread
    over devices. Not waited for: its export waits for the program writing it (`_over`)."""
    return array._fully_replicated_shard() if array.is_fully_replicated else None


def _over(array, shape: torch.Size) -> torch.Tensor:
    """A CPU tensor of `shape` over the memory of the single-device CPU-platform `array`,
    exported to DLPack: while the tensor lives, donating the buffer copies it. The export
    returns once the program writing the buffer has finished, so nothing else waits for it."""
    host = _from_dlpack(_jax().buffer_to_dlpack_managed_tensor(array, stream=None))
    return host if host.shape == shape else host.view(shape)


@functools.cache
def _jax():
    """The runtime's own module (imported on first use, as JAX is everywhere here)."""
    from jax._src.lib import _jax

    return _jax


_from_dlpack = torch._C._from_dlpack


def claim(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s own device buffer as a host tensor that gloo may write, or None where there is none.

    Only where device memory is host memory, and only for a tensor that covers its whole storage
    (its dtype, contiguous, no math bits) whose materialised buffer nothing but the storage
    holds. That buffer is donated to an identity program: JAX waits for the programs still
    reading it and, while host views of it exist, copies instead of aliasing, so the memory
    returned is ours alone. The program's result becomes the storage's buffer, so `t` and every
    view of its storage see what is written into the returned tensor; keep that tensor only
    until gloo is done with it (while it lives, claiming the buffer again yields None).

    The returned tensor is an export of the storage's array itself: `_host_memory`'s export of a
    new array object over the same buffer costs ~15 us more on a new array (it makes the new
    object's sharding), paid by every claim. The export's reference to the array is dropped when
    the runtime collects its garbage (at its next program call, or here), so the collection comes
    before the reference count is read.
    """
    if not runtime.runtime().device_memory_is_host:
        return None
    owned = _claimed(t, storage.buffer_of(t))
    return None if owned is None else _over(owned, t.shape)


def _claimed(t: torch.Tensor, buffer: storage.DeviceBuffer, results: ResultArrays | None = None):
    """`claim`'s donated array for `t` and its storage's `buffer`, not yet exported (nor waited
    for); None where there is none (a never-written storage has no buffer, and is not read: that
    would make one of zeros). CPU platform only. An array that `results` handed out is held by it
    too."""
    if buffer.value is None or buffer.sharded or memory.whole_array(t, buffer) is None:
        return None
    _jax().collect_garbage()
    # Held by nothing else than the storage, the argument (and the pool that handed it out).
    if sys.getrefcount(buffer.value) > 2 + (results is not None and results.holds(buffer.value)):
        return None
    owned = _donate()(buffer.value)
    buffer.value = owned
    counters.count("dist_buffers_claimed")
    return owned


@functools.cache
def _donate():
    """The identity on a donated buffer (jit compiles it once per shape and dtype)."""
    import jax

    return jax.jit(lambda flat: flat, donate_argnums=0)


_SIZES_COUNTED = 1024  # sizes whose requests `ResultArrays` counts before pooling them (forgotten all at once)

_pools: weakref.WeakSet = weakref.WeakSet()  # every live `ResultArrays` and `ReceiveBuffers`


def release_pools() -> None:
    """Forget every pooled result array and receive buffer of this process (`torch.tpu.empty_cache`):
    memory that no tensor uses is freed, and later calls pool again from scratch."""
    for pool in list(_pools):
        pool.clear()


class _Pool:
    """What both pools share: their bounds, the bytes they keep (in use or not), by size from
    the least recently used, and forgetting all of it (`release_pools`)."""

    def __init__(self, per_size: int, max_bytes: int) -> None:
        self._per_size = per_size
        self._max_bytes = max_bytes
        self._pooled = 0
        self._pool: OrderedDict = OrderedDict()
        _pools.add(self)

    @property
    def pooled_bytes(self) -> int:
        return self._pooled

    def clear(self) -> None:
        """Forget everything pooled (what is still in use stays with its users)."""
        self._pool.clear()
        self._pooled = 0


class ResultArrays(_Pool):
    """Device arrays that whole new outputs receive into, each reused once nothing but this pool
    holds it.

    A fresh output (`torch.empty`, what TorchRec's all-to-alls write into every step) has no
    device buffer. Giving it a pooled host buffer costs an import into JAX per call, and its
    release when the output dies; an array of this pool is claimed instead, as an output's own
    buffer is (`claim`): JAX waits for the programs still reading it and, where host views of it
    exist, copies. Its donated result aliases the same memory and takes its place here. An array
    whose buffer a program took (donated, `is_deleted`) leaves the pool. Only exact sizes are
    reused (a device buffer holds exactly its storage's elements), and each size compiles the
    identity once (~10-20 ms), so a size is pooled only once it was asked for `recurring` times:
    every step's outputs are, while sizes that come and go (an all-to-all of varying splits)
    take a fresh array each time, as before the pool, and neither compile nor stay pooled. At
    most `per_size` arrays of a size and `max_bytes` in all are pooled, the least recently used
    sizes forgotten first. CPU platform only (device memory is host memory). `torchtpu.metrics()`
    counts reuses as `dist_results_reused`."""

    def __init__(self, per_size: int = 4, max_bytes: int = 512 << 20, recurring: int = 3) -> None:
        super().__init__(per_size, max_bytes)  # pooled: (numel, dtype, device) -> arrays
        self._recurring = recurring
        self._asked: dict[tuple[int, torch.dtype, int], int] = {}  # times each size not yet pooled was asked for
        self._ids: set[int] = set()  # of the pooled arrays, which the pool keeps alive

    def clear(self) -> None:
        super().clear()
        self._ids.clear()
        self._asked.clear()

    def holds(self, array) -> bool:
        """Whether `array` is one of the pool's."""
        return id(array) in self._ids

    def take(self, numel: int, dtype: torch.dtype, index: int):
        """A ready flat array of `numel` elements of `dtype` on device `index` that nothing else
        holds or reads."""
        key = (numel, dtype, index)
        arrays = self._pool.get(key)
        if arrays is None:
            asked = self._asked.get(key, 0) + 1
            if asked < self._recurring:
                if len(self._asked) >= _SIZES_COUNTED:
                    self._asked.clear()
                self._asked[key] = asked
                return _fresh_array(numel, dtype, index)
            self._asked.pop(key, None)
            arrays = self._pool[key] = []
        self._pool.move_to_end(key)
        _jax().collect_garbage()  # exports' references to arrays go at the runtime's collection
        i = 0
        while i < len(arrays):
            array = arrays[i]
            if array.is_deleted():  # a program took its buffer
                self._drop(arrays, i, numel * dtype.itemsize)
                continue
            if sys.getrefcount(array) == 3:  # the pool's, `array`'s and the argument's
                owned = _donate()(array)
                self._ids.discard(id(array))
                self._ids.add(id(owned))
                arrays[i] = owned
                owned.block_until_ready()
                counters.count("dist_results_reused")
                return owned
            i += 1
        array = _fresh_array(numel, dtype, index)
        if len(arrays) < self._per_size:
            arrays.append(array)
            self._ids.add(id(array))
            self._pooled += numel * dtype.itemsize
            self._forget_oldest()
        return array

    def _drop(self, arrays: list, i: int, nbytes: int) -> None:
        self._ids.discard(id(arrays.pop(i)))
        self._pooled -= nbytes

    def _forget_oldest(self) -> None:
        while self._pooled > self._max_bytes and len(self._pool) > 1:
            (numel, dtype, _), arrays = self._pool.popitem(last=False)
            while arrays:
                self._drop(arrays, 0, numel * dtype.itemsize)


def _fresh_array(numel: int, dtype: torch.dtype, index: int):
    """A new flat array on CPU-platform device `index`, over new host memory."""
    return memory.array_over_host(torch.empty(numel, dtype=dtype), index)


class ReceiveBuffers(_Pool):
    """Host buffers that results arrive in, reused once their device arrays are gone: the
    results of outputs that are views (copied into them), and every result off the CPU platform
    (where device memory is not host memory) or without `ResultArrays`.

    A result buffer may become its output's device buffer (`memory.move_from_host`), so it cannot
    be reused while any device array (or a host view of one) still uses it. Each buffer handed out is a view of a pooled
    allocation; the view, and the DLPack export of it, hold references to the allocation's
    storage, so its use count is back to its value at allocation exactly when the last user has
    let go. Reusing allocations matters: fresh pages cost the kernel more to map and zero than
    gloo takes to fill them. Sizes are rounded up (by at most 25%) so that varying sizes share
    allocations; at most `max_bytes` are pooled, the least recently used sizes are forgotten first.
    """

    def __init__(self, per_size: int = 4, max_bytes: int = 512 << 20) -> None:
        super().__init__(per_size, max_bytes)  # pooled: rounded size -> (allocation, idle use count)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = _rounded(nbytes)
        allocations = self._pool.setdefault(size, [])
        self._pool.move_to_end(size)
        for allocation, idle in allocations:
            if _use_count(allocation) == idle:
                break
        else:
            allocation = torch.empty(size, dtype=torch.uint8)
            if len(allocations) < self._per_size:
                allocations.append((allocation, _use_count(allocation)))
                self._pooled += size
                self._forget_oldest()
        return allocation[:nbytes].view(dtype).view(shape)

    def _forget_oldest(self) -> None:
        while self._pooled > self._max_bytes and len(self._pool) > 1:
            size, allocations = self._pool.popitem(last=False)
            self._pooled -= size * len(allocations)


def _rounded(nbytes: int) -> int:
    """Allocation size for `nbytes`: a multiple of an eighth to a quarter of it, and of a page."""
    step = 1 << max(nbytes.bit_length() - 3, 12)
    return -(-nbytes // step) * step


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _borrowed(host: torch.Tensor) -> torch.Tensor:
    """A tensor over `host`'s memory that does not keep that memory alive: what gloo is given.

    Gloo's worker thread lets go of a collective's tensors some time after the work completes.
    Were those the owners of a device buffer's DLPack export, the next call's `claim` of that
    buffer would often find it still exported, and JAX would copy it instead of aliasing it
    (6-7 of 25 calls of a busy 64 MiB all-to-all, ~46 ms each); a pooled receive buffer would
    look busy and a fresh one be mapped. The owners stay with the transport until gloo is done
    (`HostTransport._in_flight`). Repeated calls lend the same memory (a claimed buffer stays
    where it is, receive buffers are pooled), so the views are cached by address."""
    if host.numel() == 0:
        return host
    return _borrowed_at(host.data_ptr(), host.dtype, tuple(host.shape))


@functools.lru_cache(maxsize=256)
def _borrowed_at(address: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over the memory at `address`, owning none of it."""
    nbytes = math.prod(shape) * dtype.itemsize
    memory = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


def _regions(host: torch.Tensor, splits: list[int]) -> Sequence[torch.Tensor]:
    """`host` (a `_borrowed` view, or empty) split along dim 0 by `splits`: the views are cached
    by address with the view they split, as repeated calls lend the same memory (a split made
    per call costs ~10 us)."""
    if not host.numel():
        return host.split(splits)
    return _regions_at(host.data_ptr(), host.dtype, tuple(host.shape), tuple(splits))


@functools.lru_cache(maxsize=256)
def _regions_at(address: int, dtype: torch.dtype, shape: tuple[int, ...],
                splits: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return _borrowed_at(address, dtype, shape).split(splits)


class _Staging:
    """The host buffers of one collective, and which tpu output each result goes to.

    Each method keeps the buffer's owner and returns a `_borrowed` view of it for gloo, or with
    `splits` its regions along dim 0 (`_regions`), as an all-to-all sends and receives them. Once
    launched, the staging holds gloo's work too, and `complete` finishes the collective.

    Each tensor's buffer is looked up once a call and passed on (`storage.buffer_of` makes a
    storage object every time)."""

    __slots__ = ("buffers", "results", "host_memory", "held", "moves", "adopted", "work")

    def __init__(self, buffers: ReceiveBuffers, results: ResultArrays | None = None) -> None:
        self.buffers = buffers
        self.results = results
        self.host_memory = runtime.runtime().device_memory_is_host
        self.held: list = []  # inputs and claimed outputs (or their exports), until gloo is done
        self.moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.adopted: list = []  # (output's buffer, pooled array that becomes its value)
        self.work: dist.Work | WorkList | None = None

    def read(self, t: torch.Tensor, splits: list[int] | None = None):
        """A host tensor with `t`'s value that gloo reads: its storage's own device memory, where
        that is host memory on one device and `t` is all of it (else its value, gathered)."""
        if self.host_memory and t.numel():
            buffer = storage.buffer_of(t)
            array = None if buffer.sharded else memory.whole_array(t, buffer)
            if array is not None:
                return self._lend(array, t, splits)
        host = host_view(t)
        self.held.append(host)
        return _split(_borrowed(host), splits)

    def update(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor with `t`'s value that gloo updates in place, the result ending in `t`."""
        buffer = storage.buffer_of(t)
        owned = _claimed(t, buffer, self.results) if self.host_memory else None
        if owned is not None:
            return self._lend(owned, t)
        host = self._result_memory(t, buffer)
        copy_bytes(host, host_view(t))
        return host

    def scratch(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor with `t`'s value that gloo may overwrite; what it writes is dropped."""
        host = self.buffers.take(tuple(t.shape), t.dtype)
        copy_bytes(host, host_view(t))
        self.held.append(host)
        return _borrowed(host)

    def receive(self, t: torch.Tensor, splits: list[int] | None = None):
        """A host tensor that gloo writes, the result ending in `t`."""
        buffer = storage.buffer_of(t)
        owned = _claimed(t, buffer, self.results) if self.host_memory else None
        if owned is not None:
            return self._lend(owned, t, splits)
        return self._result_memory(t, buffer, splits)

    def _result_memory(self, t: torch.Tensor, buffer: storage.DeviceBuffer, splits: list[int] | None = None):
        """Memory of `t`'s shape that gloo writes `t`'s result into: a pooled device array that
        becomes the value of `t`'s storage's `buffer` where `t` fills its storage (and `results`
        were given), else a pooled host buffer, copied into `t` (or made its buffer where
        possible) on delivery."""
        if self.results is not None and t.numel() and memory.fills_storage(t, buffer):
            array = self.results.take(t.numel(), t.dtype, t.device.index)
            self.adopted.append((buffer, array))
            return _lent_at(array.unsafe_buffer_pointer(), t, splits)
        host = self.buffers.take(tuple(t.shape), t.dtype)
        self.moves.append((t, host))
        return _split(_borrowed(host), splits)

    def _lend(self, array, t: torch.Tensor, splits: list[int] | None = None):
        """`t`'s view of the memory of the single-device CPU-platform `array`, for gloo, once the
        program writing it has finished (the export waits for it).

        What is held until gloo is done is the buffer's DLPack export itself (as in `_over`, but
        not made into a tensor: it keeps the buffer allocated and makes donating it copy), and
        what gloo gets is the `_borrowed_at` view of its address: a tensor made and freed per
        call, and `_borrowed`'s reading of it, cost ~10 us a call for nothing."""
        if not t.numel():
            host = _over(array, t.shape)
            self.held.append(host)
            return _split(host, splits)
        self.held.append(_jax().buffer_to_dlpack_managed_tensor(array, stream=None))
        return _lent_at(array.unsafe_buffer_pointer(), t, splits)

    def complete(self, timeout: timedelta | None) -> None:
        """Wait for the launched collective, then deliver its results (a `TpuWork`'s completion)."""
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        self.deliver()

    def deliver(self) -> None:
        self.held.clear()
        for buffer, array in self.adopted:
            buffer.value = array
        self.adopted.clear()
        for dst, src in self.moves:
            memory.move_from_host(dst, src)
        self.moves.clear()


def _lent_at(address: int, t: torch.Tensor, splits: list[int] | None):
    """`t`'s view of the memory at `address` (cached, `_borrowed_at`), or its regions."""
    if splits is None:
        return _borrowed_at(address, t.dtype, tuple(t.shape))
    return _regions_at(address, t.dtype, tuple(t.shape), tuple(splits))


def _split(host: torch.Tensor, splits: list[int] | None):
    """`host` (a `_borrowed` view), or its regions along dim 0 by `splits`."""
    return host if splits is None else _regions(host, splits)


_IN_FLIGHT_KEPT = 16  # launched stagings kept before the completed ones are let go


class HostTransport:
    """c10d collectives on tpu tensors (the methods and arguments of a c10d Backend), over gloo.

    Each call reads its inputs before it stages its outputs: an output that is also an input
    (in place, or aliasing it) is then claimed while the input's host view exists, so it gets
    memory of its own and gloo never writes what it still has to read."""

    def __init__(self, gloo: dist.ProcessGroupGloo, pairwise: Pairwise, rank: int) -> None:
        self._gloo = gloo
        self._pairwise = pairwise
        self._rank = rank
        self._buffers = ReceiveBuffers()
        self._results = ResultArrays() if runtime.runtime().device_memory_is_host else None
        # Gloo holds only borrowed views: the staging of each launched collective stays here
        # until gloo reports it completed, even if its work is never waited on or its wait fails
        # (looked at once `_IN_FLIGHT_KEPT` are kept: the staging of a collective never waited
        # on may outlive its completion by that many launches).
        self._in_flight: list[_Staging] = []

    def _launch(
        self, collective: str, staging: _Staging, work: dist.Work | WorkList, result: Tensors,
        any_source: bool = False,
    ) -> TpuWork:
        staging.work = work
        if len(self._in_flight) >= _IN_FLIGHT_KEPT:
            self._in_flight = [s for s in self._in_flight if not s.work.is_completed()]
        self._in_flight.append(staging)
        source_rank = work._source_rank if any_source else None
        return TpuWork(collective, self._rank, staging.complete, result, source_rank)

    def allreduce(self, tensors: Tensors, opts: dist.AllreduceOptions) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        return self._launch("all_reduce", s, self._gloo.allreduce([s.update(t) for t in tensors], opts), tensors)

    def allreduce_coalesced(self, tensors: Tensors, opts: dist.AllreduceCoalescedOptions) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        work = self._gloo.allreduce_coalesced([s.update(t) for t in tensors], opts)
        return self._launch("all_reduce_coalesced", s, work, tensors)

    def reduce(self, tensors: Tensors, opts: dist.ReduceOptions) -> TpuWork:
        """Gloo uses the other ranks' tensors as scratch space: they get copies instead, and keep
        their values (as the XLA transport's and NCCL's do)."""
        s = _Staging(self._buffers, self._results)
        root = self._rank == opts.rootRank
        host = [s.update(t) if root else s.scratch(t) for t in tensors]
        return self._launch("reduce", s, self._gloo.reduce(host, opts), tensors)

    def broadcast(self, tensors: Tensors, opts: dist.BroadcastOptions) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        root = opts.rootTensor if self._rank == opts.rootRank else None
        source = s.read(tensors[root]) if root is not None else None
        host = [source if i == root else s.receive(t) for i, t in enumerate(tensors)]
        return self._launch("broadcast", s, self._gloo.broadcast(host, opts), tensors)

    def allgather(self, outputs: Sequence[Tensors], inputs: Tensors, opts: dist.AllgatherOptions) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        host_in = [s.read(t) for t in inputs]
        work = self._gloo.allgather([[s.receive(t) for t in group] for group in outputs], host_in, opts)
        return self._launch("all_gather", s, work, [t for group in outputs for t in group])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: dist.AllgatherOptions) -> TpuWork:
        """Any shapes of matching sizes, as NCCL takes them (gloo's own splits the output along
        dim 0: SyncBatchNorm gathers `[C]` into `[1, world * C]`): gloo gets both flat."""
        s = _Staging(self._buffers, self._results)
        host_in = s.read(input).view(-1)
        work = self._gloo._allgather_base(s.receive(output).view(-1), host_in, opts)
        return self._launch("all_gather_into_tensor", s, work, [output])

    def gather(self, outputs: Sequence[Tensors], inputs: Tensors, opts: dist.GatherOptions) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        host_in = [s.read(t) for t in inputs]
        work = self._gloo.gather([[s.receive(t) for t in group] for group in outputs], host_in, opts)
        return self._launch("gather", s, work, [t for group in outputs for t in group])

    def scatter(self, outputs: Tensors, inputs: Sequence[Tensors], opts: dist.ScatterOptions) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        host_in = [[s.read(t) for t in group] for group in inputs]
        work = self._gloo.scatter([s.receive(t) for t in outputs], host_in, opts)
        return self._launch("scatter", s, work, outputs)

    def reduce_scatter(self, outputs: Tensors, inputs: Sequence[Tensors], opts: dist.ReduceScatterOptions) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        host_in = [[s.read(t) for t in group] for group in inputs]
        work = self._gloo.reduce_scatter([s.receive(t) for t in outputs], host_in, opts)
        return self._launch("reduce_scatter", s, work, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: dist.ReduceScatterOptions) -> TpuWork:
        """Any shapes of matching sizes, flat for gloo (as `all_gather_single`)."""
        s = _Staging(self._buffers, self._results)
        host_in = s.read(input).view(-1)
        work = self._gloo._reduce_scatter_base(s.receive(output).view(-1), host_in, opts)
        return self._launch("reduce_scatter_tensor", s, work, [output])

    def stage_all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                                sizes: ExchangeSizes) -> Callable[[], TpuWork]:
        """The host buffers of an all-to-all of `sizes`, staged; the call returned starts it."""
        s = _Staging(self._buffers, self._results)
        send, recv = sizes.splits(self._rank)
        host_in = s.read(input, send)
        host_out = s.receive(output, recv)

        def start() -> TpuWork:
            return self._launch("all_to_all_single", s, self._pairwise.exchange(host_out, host_in), [output])

        return start

    def alltoall(self, outputs: Tensors, inputs: Tensors, sizes: ExchangeSizes) -> TpuWork:
        """The list form: tensor j goes to rank j, each straight from and into its own buffer
        (`sizes`, agreed, are those of the tensors)."""
        s = _Staging(self._buffers, self._results)
        host_in = [s.read(t) for t in inputs]
        work = self._pairwise.exchange([s.receive(t) for t in outputs], host_in)
        return self._launch("all_to_all", s, work, outputs)

    def send(self, tensors: Tensors, dst: int, tag: int) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        return self._launch("send", s, self._gloo.send([s.read(t) for t in tensors], dst, tag), tensors)

    def recv(self, tensors: Tensors, src: int, tag: int) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        return self._launch("recv", s, self._gloo.recv([s.receive(t) for t in tensors], src, tag), tensors)

    def recv_anysource(self, tensors: Tensors, tag: int) -> TpuWork:
        s = _Staging(self._buffers, self._results)
        work = self._gloo.recv_anysource([s.receive(t) for t in tensors], tag)
        return self._launch("recv", s, work, tensors, any_source=True)
