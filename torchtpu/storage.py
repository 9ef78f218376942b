"""Device storage: how a `tpu` tensor's data lives in a PJRT buffer.

A `tpu` tensor is a real PrivateUse1 TensorImpl. Its `UntypedStorage` has the right byte size but
holds no host data (a null data pointer); the device data belongs to the storage as a
`DeviceBuffer`, attached to the storage's (preserved) Python object. The buffer is one flat
`jax.Array` per storage. Every tensor that shares the storage -- the base, its views, `.data`,
`detach()` -- reads and writes its own region of that flat buffer by its sizes, strides and
storage offset, which is exactly PyTorch's aliasing model (see `torchtpu.strided`).

Tensors on `tpu:i` are made from a per-(device, dtype) seed tensor: `seed.data` gives a fresh
TensorImpl (own version counter) on the right device, which is then pointed at a new storage.
The seeds come from DLPack, the one public path that builds a PrivateUse1 tensor on a device
index other than 0.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Sequence

import torch

from torchtpu import dtypes

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
_new_storage = torch._C._construct_storage_from_data_pointer

BUFFER_ATTR = "_tpu_buffer"


class _Stats:
    """Bytes of live device storages, per device (what `torch.tpu.memory_allocated` reports)."""

    def __init__(self) -> None:
        self.allocated: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.lock = threading.Lock()

    def add(self, device: int, nbytes: int) -> None:
        allocated = self.allocated
        with self.lock:
            now = allocated[device] = allocated.get(device, 0) + nbytes
            if nbytes > 0 and now > self.peak.get(device, 0):
                self.peak[device] = now


stats = _Stats()
_ITEMSIZE = {dtype: dtypes.itemsize(dtype) for dtype in dtypes.SUPPORTED}


class DeviceBuffer:
    """The device data of one storage.

    `value` is a flat 1-D array of `dtype` with `numel` elements: a `jax.Array`, a pending value
    of the deferred executor, or None for storage that was allocated but never written (it reads
    as zeros, like fresh device memory that happens to be cleared).
    """

    __slots__ = ("value", "dtype", "numel", "device", "nbytes", "untyped", "sharded", "__weakref__")

    def __init__(self, dtype: torch.dtype, numel: int, device: int, value: Any = None,
                 untyped: bool = False) -> None:
        self.value = value
        self.dtype = dtype
        self.numel = numel
        self.device = device
        self.nbytes = nbytes = numel * _ITEMSIZE[dtype]
        # Raw bytes (e.g. a storage restored by torch.load): the first tensor that reads it with
        # another dtype decides the element type (see `retype`).
        self.untyped = untyped
        # Spread over the devices of `torchtpu.sharding.mesh()` (see torchtpu.sharding).
        self.sharded = False
        stats.add(device, nbytes)

    def retype(self, dtype: torch.dtype) -> None:
        """Reinterpret raw bytes as elements of `dtype`, once, so later reads take the fast path."""
        if not self.untyped or dtype == self.dtype or self.nbytes % dtypes.itemsize(dtype):
            return
        if self.value is not None:
            import jax

            from torchtpu import strided

            self.value = jax.jit(strided.reinterpret, static_argnums=1)(self.value, dtypes.to_jax(dtype))
        self.dtype = dtype
        self.numel = self.nbytes // dtypes.itemsize(dtype)
        self.untyped = False

    def __del__(self) -> None:
        try:
            stats.add(self.device, -self.nbytes)
        except Exception:  # interpreter shutdown: the stats may already be gone
            pass


# --- seeds: one PrivateUse1 tensor per (device index, dtype), made through DLPack -------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))),
]

_KDL_EXT_DEV = 12  # DLPack's extension device type; PyTorch maps it to PrivateUse1
_DL_CODES = {
    torch.float32: (2, 32), torch.float64: (2, 64), torch.float16: (2, 16),
    torch.bfloat16: (4, 16), torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32),
    torch.int64: (0, 64), torch.uint8: (1, 8), torch.bool: (6, 8),
    torch.complex64: (5, 64), torch.complex128: (5, 128),
}
# A function object of our own: `ctypes.pythonapi.PyCapsule_New` is one object shared by every
# library in the process, and others set its argument types too (`jax.ffi.pycapsule` does).
_capsule_new = ctypes.PyDLL(None).PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_seeds: dict[tuple[int, torch.dtype], torch.Tensor] = {}
_seed_keepalive: list[Any] = []
_seed_lock = threading.Lock()


def _make_seed(device: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (ctypes.c_int64 * 1)(0)
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = None
    managed.dl_tensor.device = _DLDevice(_KDL_EXT_DEV, device)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(*_DL_CODES[dtype], 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    # The seed lives as long as the process and has no deleter: keep its structures alive.
    _seed_keepalive.append((managed, shape, strides))
    capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
    return torch._C._from_dlpack(capsule)


def _seed(device: int, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    seed = _seeds.get(key)
    if seed is None:
        dtypes.check_supported(dtype)
        with _seed_lock:
            seed = _seeds.get(key)
            if seed is None:
                seed = _seeds[key] = _make_seed(device, dtype)
    return seed


# --- making tensors ---------------------------------------------------------------------------


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(sizes):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


class _AddressSpace:
    """Device "addresses" for storages.

    A storage's data pointer never points to host memory, but PyTorch and libraries use it as an
    identity (`torch.save` keys storages by it; safetensors detects shared tensors by address
    ranges; a null pointer makes PyTorch call the storage invalid). Each storage therefore gets a
    range of its own in a 64-bit space above any host address, handed out once and never reused.
    """

    _BASE = 1 << 56
    ALIGN = 64
    CHUNK = 1 << 36  # what a thread reserves at once for the tensors it makes (`_Maker`)

    def __init__(self) -> None:
        self.next = self._BASE
        self.lock = threading.Lock()

    def reserve(self, nbytes: int) -> int:
        with self.lock:
            address = self.next
            self.next += (max(nbytes, 1) + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        return address


_addresses = _AddressSpace()
reserve_addresses = _addresses.reserve  # for the C++ fast path's own tensors (exec/fast_dispatch)
ADDRESS_CHUNK = _AddressSpace.CHUNK


def new_storage(buffer: DeviceBuffer) -> torch.UntypedStorage:
    """A storage on `buffer`'s device that owns `buffer`."""
    storage = _new_storage(_addresses.reserve(buffer.nbytes), torch.device("tpu", buffer.device), buffer.nbytes)
    setattr(storage, BUFFER_ATTR, buffer)
    return storage


def attach(t: torch.Tensor, buffer: DeviceBuffer, sizes, strides, offset: int = 0) -> torch.Tensor:
    """Point `t` at a new storage that owns `buffer`, with the given geometry."""
    storage = new_storage(buffer)
    _set_storage.redispatch(_CPU_KEYS, t, storage, offset, sizes, strides)
    return t


class _Maker(threading.local):
    """A thread's DLPack descriptors for making tensors over a fresh storage in one call.

    `torch._C._from_dlpack` builds a TensorImpl with a descriptor's sizes and strides over a new
    storage of exactly the bytes they span, at the descriptor's (device) address. Descriptors
    have no deleter and live as long as the process (each storage made from one keeps a pointer
    to it, read when the storage is freed), so there is one per thread and layout (device, dtype,
    sizes, strides), reused for every tensor of that layout with only the address changed."""

    def __init__(self) -> None:
        self.layouts: dict[tuple, tuple[Any, int]] = {}
        # A range of addresses this thread hands out without taking the global lock.
        self.next = self.end = 0

    def _address(self, nbytes: int) -> int:
        size = (max(nbytes, 1) + _AddressSpace.ALIGN - 1) // _AddressSpace.ALIGN * _AddressSpace.ALIGN
        address = self.next
        if address + size > self.end:
            chunk = max(size, _AddressSpace.CHUNK)
            address = _addresses.reserve(chunk)
            self.end = address + chunk
        self.next = address + size
        return address

    def _descriptor(self, layout: tuple) -> tuple[Any, int]:
        device, dtype, sizes, strides = layout
        ndim = len(sizes)
        shape = (ctypes.c_int64 * max(ndim, 1))(*sizes)
        steps = (ctypes.c_int64 * max(ndim, 1))(*strides)
        managed = _DLManagedTensor()
        managed.dl_tensor.device = _DLDevice(_KDL_EXT_DEV, device)
        managed.dl_tensor.dtype = _DLDataType(*_DL_CODES[dtype], 1)
        managed.dl_tensor.ndim = ndim
        managed.dl_tensor.shape = shape
        managed.dl_tensor.strides = steps
        with _seed_lock:
            _seed_keepalive.append((managed, shape, steps))
        descriptor = self.layouts[layout] = (managed.dl_tensor, ctypes.addressof(managed))
        return descriptor

    def make(self, buffer: DeviceBuffer, sizes: tuple, strides: tuple) -> torch.Tensor:
        layout = (buffer.device, buffer.dtype, sizes, strides)
        descriptor = self.layouts.get(layout)
        if descriptor is None:
            descriptor = self._descriptor(layout)
        tensor, address = descriptor
        tensor.data = self._address(buffer.nbytes)
        t = _from_dlpack(_capsule_new(address, b"dltensor", None))
        setattr(t.untyped_storage(), BUFFER_ATTR, buffer)
        return t


_from_dlpack = torch._C._from_dlpack
_maker = _Maker()


def whole_tensor(buffer: DeviceBuffer, sizes: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """A new `tpu` tensor of `buffer.dtype` whose geometry (offset 0) spans exactly `buffer`, as
    the executors' fresh outputs do."""
    return _maker.make(buffer, tuple(sizes), tuple(strides))


def new_tensor(
    buffer: DeviceBuffer,
    sizes: Sequence[int],
    strides: Sequence[int] | None = None,
    offset: int = 0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A new `tpu` tensor on `buffer.device` viewing `buffer` (dtype defaults to the buffer's)."""
    if strides is None:
        strides = contiguous_strides(sizes)
    if (
        offset == 0
        and (dtype is None or dtype == buffer.dtype)
        and storage_numel(sizes, strides) == buffer.numel
    ):
        return _maker.make(buffer, tuple(sizes), tuple(strides))
    t = _seed(buffer.device, dtype or buffer.dtype).data
    return attach(t, buffer, sizes, strides, offset)


def empty(sizes: Sequence[int], dtype: torch.dtype, device: int, strides=None) -> torch.Tensor:
    """An uninitialised tensor: its storage reads as zeros until written."""
    sizes = tuple(sizes)
    given = strides is not None
    strides = contiguous_strides(sizes) if strides is None else tuple(strides)
    numel = storage_numel(sizes, strides)
    if numel * _ITEMSIZE[dtype] >= 1 << 63:  # PyTorch's own limit (and message): bytes in an int64
        shown = f" and strides={list(strides)}" if given else ""
        raise RuntimeError(f"Storage size calculation overflowed with sizes={list(sizes)}{shown}")
    return new_tensor(DeviceBuffer(dtype, numel, device), sizes, strides)


def storage_numel(sizes: Sequence[int], strides: Sequence[int], offset: int = 0) -> int:
    """Elements a storage needs to hold a tensor of this geometry."""
    if any(s == 0 for s in sizes):
        return offset
    return offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides))


def buffer_of(t: torch.Tensor) -> DeviceBuffer:
    """The device buffer behind a `tpu` tensor."""
    storage = t.untyped_storage()
    buffer = getattr(storage, BUFFER_ATTR, None)
    if buffer is None:
        # A storage that PyTorch allocated itself (e.g. `UntypedStorage(n, device="tpu")`):
        # give it fresh device memory of its byte size, read as elements of this tensor's dtype.
        buffer = DeviceBuffer(t.dtype, storage.nbytes() // dtypes.itemsize(t.dtype), t.device.index)
        setattr(storage, BUFFER_ATTR, buffer)
    elif buffer.untyped and buffer.dtype != t.dtype:
        buffer.retype(t.dtype)
    return buffer


def set_buffer(t: torch.Tensor, buffer: DeviceBuffer) -> None:
    setattr(t.untyped_storage(), BUFFER_ATTR, buffer)
