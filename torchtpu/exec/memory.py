"""Kernels that allocate, move and resize device memory rather than compute.

`empty*` allocate storage (it reads as zeros until written); `copy_` moves data between the host
and devices and between devices; `resize_`/`set_` change a tensor's storage; `_local_scalar_dense`
(`Tensor.item()`) reads one value to the host. Same-device copies are ordinary ops and go through
the executors like any other.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from torchtpu import dtypes, out_of_memory, runtime, storage, strided
from torchtpu.exec import checks, modes

aten = torch.ops.aten


def _device_index(device) -> int:
    from torchtpu.device import current_device

    if device is None:
        return current_device()
    device = torch.device(device)
    return current_device() if device.index is None else device.index


def _check_device(index: int) -> int:
    runtime.jax_device(index)  # validates the index and takes the device's process lock
    return index


def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None,
                        memory_format=None) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    dtypes.check_supported(dtype)
    index = _check_device(_device_index(device))
    sizes = tuple(int(s) for s in size)
    strides = None
    if memory_format in (torch.channels_last, torch.channels_last_3d):
        strides = torch.empty(sizes, device="meta", memory_format=memory_format).stride()
    return storage.empty(sizes, dtype, index, strides)


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    dtypes.check_supported(dtype)
    index = _check_device(_device_index(device))
    return storage.empty(tuple(int(s) for s in size), dtype, index, tuple(int(s) for s in stride))


# --- reading to the host ----------------------------------------------------------------------


def _materialized(buffer: storage.DeviceBuffer):
    if modes.current() == "defer" or not _is_array(buffer.value):
        from torchtpu.exec import deferred

        deferred.materialize(buffer, reason="host read")
    return buffer.value


def _is_array(value) -> bool:
    return value is None or hasattr(value, "block_until_ready")


_read_programs: dict[tuple, object] = {}


def clear_cache() -> None:
    _read_programs.clear()


def to_array(t: torch.Tensor):
    """The logical value of a `tpu` tensor as a flat, row-major `jax.Array` on its device.

    Pending work is materialised first. A tensor that covers its whole storage gets the storage's
    own buffer (no copy); any other view is gathered by a cached program.
    """
    buffer = storage.buffer_of(t)
    whole = whole_array(t, buffer)
    if whole is not None:
        return whole
    import jax

    value, conj, neg = buffer.value, t.is_conj(), t.is_neg()  # materialised by `whole_array`
    np_dtype = dtypes.to_jax(t.dtype)
    if value is None:
        with out_of_memory.raised_as_torch():
            return jax.device_put(np.zeros(t.numel(), np_dtype), runtime.jax_device(buffer.device))
    geometry = strided.Geometry(tuple(t.shape), tuple(t.stride()), t.storage_offset())
    key = (geometry, t.dtype, buffer.dtype, buffer.numel, conj, neg)
    read = _read_programs.get(key)
    if read is None:
        def read_fn(flat):
            out = strided.read(strided.reinterpret(flat, np_dtype), geometry).reshape(-1)
            out = out.conj() if conj else out
            return -out if neg else out

        read = _read_programs[key] = jax.jit(read_fn)
    return read(value)


def whole_array(t: torch.Tensor, buffer: storage.DeviceBuffer):
    """The storage's own array when `t` is all of it (contiguous, in its dtype, no math bits):
    `t`'s value without a program. Pending work is materialised and failed device checks raised
    first; None for any other view, or a storage never written. The common case of `to_array`,
    and what collectives read and write in place (they pay this check per call)."""
    value = _materialized(buffer)
    checks.raise_pending()
    if value is not None and not (t.is_conj() or t.is_neg()) and _covers(t, buffer):
        return value
    return None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """The logical value of a `tpu` tensor as a host numpy array (bf16 as ml_dtypes.bfloat16).

    Where device memory is host memory (the CPU platform) this is a read-only view of it. A
    sharded tensor is gathered (in a multi-process job every process must take part)."""
    value = to_array(t)
    if not getattr(value, "is_fully_addressable", True):
        from jax.experimental import multihost_utils

        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(value).reshape(tuple(t.shape))


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over `array`'s memory (no copy where possible; may be read-only memory, so
    callers copy out of it rather than write to it)."""
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = array.copy(order="C")
    if array.dtype == dtypes.to_jax(torch.bfloat16):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtypes.to_jax(torch.bfloat16))
    return t.numpy()


def local_scalar_dense(t: torch.Tensor):
    value = to_numpy(t).reshape(()).item()
    if t.dtype == torch.bool:
        return bool(value)
    return value


# --- moving data ------------------------------------------------------------------------------


def host_to_device(array: np.ndarray, index: int):
    """A device array holding a private copy of host memory.

    On the CPU platform `jax.device_put` may alias the numpy buffer instead of copying it; the
    caller's host memory (a CPU tensor's storage) stays mutable, so copy it first.
    """
    import jax

    with out_of_memory.raised_as_torch():
        return jax.device_put(np.array(array, copy=True, order="C"), runtime.jax_device(index))


def array_over_host(src: torch.Tensor, index: int):
    """A `jax.Array` on CPU-platform device `index` over the memory of the contiguous CPU tensor
    `src` (no copy; it keeps `src`'s memory alive). Every device of the platform addresses host
    memory, so any of them can adopt it.

    This is `jax.dlpack.from_dlpack(src)` without what that adds around the one runtime call
    made here (a stream query that raises on the CPU platform, a `jnp.asarray`; and
    `Tensor.__dlpack__`'s checks): ~150 us a call against ~20 us, paid per collective output
    on the stand-in."""
    from jax._src.lib import _jax

    dl_cpu = 1  # kDLCPU
    return _jax.dlpack_managed_tensor_to_buffer(torch._C._to_dlpack(src), runtime.jax_device(index), None, None, dl_cpu)


def move_from_host(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)` for a CPU tensor `src` that the caller gives up (a receive buffer).

    Where device memory is host memory (the CPU platform) and `dst` covers its whole storage, a
    contiguous `src` of `dst`'s shape and dtype becomes `dst`'s device buffer without a copy.
    Anything else is an ordinary `copy_`. The caller must not use `src` afterwards.
    """
    whole = src.dtype == dst.dtype and src.is_contiguous() and _fills_whole(dst, src)
    if not runtime.runtime().device_memory_is_host or not whole:
        return copy_(dst, src)
    storage.buffer_of(dst).value = array_over_host(src.reshape(-1), dst.device.index)
    return dst


def from_host(src: torch.Tensor, index: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous `tpu:index` tensor holding the CPU tensor `src` (converted to `dtype`)."""
    dtype = dtype or src.dtype
    dtypes.check_supported(dtype)
    if src.dtype != dtype:
        src = src.to(dtype)
    array = torch_to_numpy(src).reshape(-1)
    buffer = storage.DeviceBuffer(dtype, array.size, index, host_to_device(array, index))
    return storage.new_tensor(buffer, tuple(src.shape))


def to_device(src: torch.Tensor, index: int) -> torch.Tensor:
    """A contiguous copy of the `tpu` tensor `src` on `tpu:index`."""
    import jax

    array = to_numpy(src) if runtime.runtime().device_memory_is_host else None
    if array is None:
        # UNTESTED on TPU: device-to-device transfer without a host round trip.
        with out_of_memory.raised_as_torch():
            value = jax.device_put(_contiguous_value(src), runtime.jax_device(index))
        numel = math.prod(src.shape)
    else:
        value = host_to_device(array.reshape(-1), index)
        numel = array.size
    buffer = storage.DeviceBuffer(src.dtype, numel, index, value)
    return storage.new_tensor(buffer, tuple(src.shape))


def _contiguous_value(t: torch.Tensor):
    contiguous = t.contiguous()
    return _materialized(storage.buffer_of(contiguous))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor over the same memory. A Python subclass may refuse the attribute
    reads a kernel makes: a lazy module's uninitialized parameter raises on `.shape`, and
    `module.to("tpu")` copies it."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    from torchtpu.exec.kernels import execute

    result, dst, src = dst, _plain(dst), _plain(src)
    if dst.device.type != "tpu":
        dst.copy_(numpy_to_torch(to_numpy(src)))
        return result
    index = dst.device.index
    if src.device.type != "tpu":
        if src.device.type != "cpu":
            raise RuntimeError(f"copy_ from {src.device} to {dst.device} is not supported")
        if _fills_whole(dst, src):
            array = torch_to_numpy(src.to(dst.dtype)).reshape(-1)
            storage.buffer_of(dst).value = host_to_device(array, index)
            return result
        src = from_host(src, index)
    elif src.device.index != index:
        src = to_device(src, index)
    execute(aten.copy_.default, (dst, src, non_blocking), {})
    return result


def fills_storage(t: torch.Tensor, buffer: storage.DeviceBuffer | None = None) -> bool:
    """`t` is contiguous over all of its storage (whose `buffer` may be given, if looked up
    already), in its storage's dtype, with no math bits: writing it replaces its buffer."""
    return not (t.is_conj() or t.is_neg()) and _covers(t, storage.buffer_of(t) if buffer is None else buffer)


def _covers(t: torch.Tensor, buffer: storage.DeviceBuffer) -> bool:
    """`t` is contiguous over all of `buffer` (its storage's), in the buffer's dtype."""
    return t.dtype == buffer.dtype and t.numel() == buffer.numel and t.storage_offset() == 0 and t.is_contiguous()


def _fills_whole(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """dst fills its storage (`fills_storage`) and src has its shape: the copy replaces it."""
    return dst.shape == src.shape and fills_storage(dst)


def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return copy_(dst, src, non_blocking)


def copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst.shape != src.shape:
        dst.resize_(src.shape)
    return copy_(dst, src)


# --- changing a tensor's storage --------------------------------------------------------------


def resize_(t: torch.Tensor, size: Sequence[int], memory_format=None) -> torch.Tensor:
    sizes = tuple(int(s) for s in size)
    strides = storage.contiguous_strides(sizes)
    if memory_format in (torch.channels_last, torch.channels_last_3d):
        strides = torch.empty(sizes, device="meta", memory_format=memory_format).stride()
    needed = storage.storage_numel(sizes, strides, t.storage_offset())
    buffer = storage.buffer_of(t)
    if needed * dtypes.itemsize(t.dtype) <= buffer.nbytes:
        storage._set_storage.redispatch(storage._CPU_KEYS, t, t.untyped_storage(), t.storage_offset(), sizes, strides)
        return t
    # Grow: a new storage whose prefix holds the old contents (as PyTorch's resize_ keeps them).
    old = _materialized(buffer)
    numel = needed if t.dtype == buffer.dtype else needed * dtypes.itemsize(t.dtype) // dtypes.itemsize(buffer.dtype)
    grown = storage.DeviceBuffer(buffer.dtype, numel, buffer.device)
    if old is not None:
        grown.value = _grow(old, numel)
    storage.attach(t, grown, sizes, strides, t.storage_offset())
    return t


def _grow(value, numel: int):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda v: jnp.pad(v, (0, numel - v.shape[0])))(value)


def set_source_storage_offset(t: torch.Tensor, source, storage_offset, size, stride=()) -> torch.Tensor:
    stride = tuple(stride) if stride else storage.contiguous_strides(size)
    return storage._set_storage.redispatch(storage._CPU_KEYS, t, source, storage_offset, size, stride)


def set_source_storage(t: torch.Tensor, source) -> torch.Tensor:
    nbytes = source.nbytes()
    n = nbytes // dtypes.itemsize(t.dtype)
    return storage._set_storage.redispatch(storage._CPU_KEYS, t, source, 0, (n,), (1,))


def set_source_tensor(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return storage._set_storage.redispatch(
        storage._CPU_KEYS, t, source.untyped_storage(), source.storage_offset(),
        tuple(source.shape), tuple(source.stride()),
    )


def set_empty(t: torch.Tensor) -> torch.Tensor:
    buffer = storage.DeviceBuffer(t.dtype, 0, t.device.index)
    return storage.attach(t, buffer, (0,), (1,))


def has_compatible_shallow_copy_type(t: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether `t.data = source` may swap `t`'s contents in place: yes between strided `tpu` and
    CPU tensors, as between CPU and CUDA. `Module.to("tpu")` then moves each Parameter in place, so
    tied weights stay tied and optimizers keep their references (PyTorch's own rule only admits
    the built-in backends, and a PrivateUse1 backend answers for itself)."""
    return t.layout == torch.strided and source.layout == torch.strided


def record_stream(t: torch.Tensor, stream) -> None:
    """`t.record_stream(stream)`: nothing to record. A device runs one queue, and a device
    buffer is not freed while a program still reads it (PJRT holds it until then), so no stream
    can see `t`'s memory reused early."""
