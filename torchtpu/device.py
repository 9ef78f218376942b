"""`torch.tpu`: the device module, and the PrivateUse1 registration behind `torch.device("tpu")`.

The backend is registered through PyTorch's Python PrivateUse1 mechanism: PrivateUse1 is renamed
to "tpu", and Python hooks and a device guard are installed, so `.to("tpu")`, `torch.compile`
(inductor included) and `torch.accelerator` keep working in the same process. The guard itself is
a small C++ one (`torchtpu.device_guard`), because the Python guard knows only one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from typing import Iterator

import torch

from torchtpu import autocast as _autocast
from torchtpu import precision as _precision
from torchtpu import random as _random
from torchtpu import device_guard, runtime, storage
from torchtpu import events as _events
from torchtpu.events import Event  # noqa: F401 (torch.tpu.Event)
from torchtpu.streams import (  # noqa: F401 (torch.tpu's streams)
    Stream, StreamContext, current_stream, default_stream, set_stream, stream,
)


OutOfMemoryError = torch.OutOfMemoryError
"""Raised when a tpu device runs out of memory (`torchtpu.out_of_memory`): torch's own class, as
`torch.cuda.OutOfMemoryError` is."""


class Precision(enum.Enum):
    """Matmul precision modes (1, 3 or 6 bf16 passes per fp32 matmul)."""

    DEFAULT = "default"
    HIGH = "high"
    HIGHEST = "highest"


def is_available() -> bool:
    """True: the CPU stand-in is always available where there is no TPU."""
    try:
        return runtime.device_count() > 0
    except Exception:
        return False


def is_initialized() -> bool:
    return runtime.is_started()


def __getattr__(name: str):
    """`torch.tpu._initialized`, which PyTorch reads as `torch.cuda`'s module global: whether the
    runtime has started (`torch.utils.checkpoint` saves and restores the device's RNG state for
    recomputation only then; without it, dropout drew new masks in the recomputed forward)."""
    if name == "_initialized":
        return runtime.is_started()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def init() -> None:
    """Start the device runtime now (as `torch.cuda.init`): it otherwise starts with the first
    tpu tensor. Calling it again does nothing."""
    runtime.runtime()


_lazy_init = init


def device_count() -> int:
    return runtime.device_count()


def current_device() -> int:
    return device_guard.current_device()


def _index(device: int | str | torch.device | None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"expected a tpu device, got {device}")
    return current_device() if device.index is None else device.index


def set_device(device: int | str | torch.device) -> None:
    index = _index(device)
    runtime.jax_device(index)
    device_guard.set_current_device(index)


@contextlib.contextmanager
def device(device: int | str | torch.device) -> Iterator[None]:
    """Context manager that changes the current tpu device."""
    previous = current_device()
    set_device(device)
    try:
        yield
    finally:
        device_guard.set_current_device(previous)


def device_of(obj: object) -> contextlib.AbstractContextManager:
    """Context manager that makes `obj`'s device current if it is a tpu tensor, else changes
    nothing (`torch.cuda.device_of`)."""
    if isinstance(obj, torch.Tensor) and obj.device.type == "tpu":
        return device(obj.device)
    return contextlib.nullcontext()


def synchronize(device: int | str | torch.device | None = None) -> None:
    """Wait until every op queued so far has finished (runs everything pending in defer mode)."""
    from torchtpu.exec import checks

    for array in _events.computing(_index(device), "synchronize"):
        array.block_until_ready()
    checks.raise_pending()


def manual_seed(seed: int) -> None:
    _random.manual_seed(seed, current_device())


def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        _random.manual_seed(seed, index)


def seed() -> None:
    import random as py_random

    manual_seed(py_random.getrandbits(63))


def seed_all() -> None:
    import random as py_random

    manual_seed_all(py_random.getrandbits(63))


def initial_seed() -> int:
    return _random.initial_seed(current_device())


def get_rng_state(device: int | str | torch.device = "tpu") -> torch.Tensor:
    return _random.get_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device: int | str | torch.device = "tpu") -> None:
    _random.set_state(new_state, _index(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [_random.get_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        _random.set_state(state, index)


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    """Bytes held by live tensors' storages on the device."""
    return storage.stats.allocated.get(_index(device), 0)


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    """Peak of `memory_allocated` since start or the last `reset_peak_memory_stats`."""
    return storage.stats.peak.get(_index(device), 0)


def _memory_stats(index: int) -> tuple[int, int]:
    """(allocated, peak) bytes of `index`: what the PrivateUse1 allocator gives `torch.accelerator`."""
    return memory_allocated(index), max_memory_allocated(index)


def memory_reserved(device: int | str | torch.device | None = None) -> int:
    """Bytes the device keeps for tensors: `memory_allocated`, as torchtpu caches no device
    memory of its own (the runtime allocates and frees each buffer). Not counted: the arrays
    collectives pool for their results on the CPU stand-in, which `empty_cache` releases."""
    return memory_allocated(device)


def max_memory_reserved(device: int | str | torch.device | None = None) -> int:
    """Peak of `memory_reserved` since start or the last `reset_peak_memory_stats`."""
    return max_memory_allocated(device)


def memory_stats(device: int | str | torch.device | None = None) -> dict[str, int]:
    """`torch.cuda.memory_stats`'s dictionary for a tpu device, as `torch.accelerator` reports it:
    the byte counts ("allocated_bytes.all.current", "reserved_bytes.all.peak", ...) are
    `memory_allocated`'s and its peak; the counts of a caching allocator's blocks and segments,
    which torchtpu has not, are 0."""
    return dict(torch.accelerator.memory_stats(torch.device("tpu", _index(device))))


def memory_summary(device: int | str | torch.device | None = None, abbreviated: bool = False) -> str:
    """A printable account of the device's memory, where `torch.cuda.memory_summary` gives one:
    the bytes of live tensors now and at their peak, what is reserved (the same), and the device's
    free and total memory. torchtpu has no caching allocator, so there are no pools, segments or
    retries to list; `abbreviated` is taken for compatibility and changes nothing."""
    index = _index(device)
    free, total = mem_get_info(index)
    rows = (("allocated now", memory_allocated(index)), ("allocated peak", max_memory_allocated(index)),
            ("reserved now", memory_reserved(index)), ("reserved peak", max_memory_reserved(index)),
            ("device free", free), ("device total", total))
    lines = [f"tpu:{index} ({get_device_name(index)}) memory"]
    lines += [f"  {name:<15} {_bytes(n)}" for name, n in rows]
    return "\n".join(lines) + "\n"


def _bytes(n: int) -> str:
    """`n` bytes, exactly and in the largest binary unit under 1024 of it: "1,048,576 B (1.0 MiB)"."""
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{n:,} B" if unit == "B" else f"{n:,} B ({value:.1f} {unit})"


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    index = _index(device)
    storage.stats.peak[index] = storage.stats.allocated.get(index, 0)


def mem_get_info(device: int | str | torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes of the device's memory: on a TPU its limit and what is not in use
    (UNTESTED: no TPU here); on the CPU stand-in, whose device memory is host memory, the host's
    available and total memory."""
    properties = get_device_properties(device)
    if properties.platform == "cpu":
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024, properties.total_memory
    stats = runtime.jax_device(properties.index).memory_stats()
    return properties.total_memory - int(stats["bytes_in_use"]), properties.total_memory


def empty_cache() -> None:
    """Release the memory torchtpu keeps for reuse that no tensor uses: the pooled buffers of
    collectives and, on the CPU stand-in, the freed device memory its heap keeps
    (`torchtpu.stand_in_memory`). Live tensors keep theirs. On a TPU, PJRT's allocator manages
    its own device memory and has nothing to release here."""
    from torchtpu import stand_in_memory
    from torchtpu.distributed import host_transport

    host_transport.release_pools()
    stand_in_memory.trim()


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """What `get_device_properties` reports of a tpu device."""

    name: str  # the runtime's device kind: "TPU v5p", ...; "cpu" on the CPU stand-in
    platform: str  # "tpu", or "cpu" on the stand-in
    index: int
    total_memory: int  # bytes the device can hold (the host's memory on the stand-in)


def get_device_name(device: int | str | torch.device | None = None) -> str:
    """The device's kind as the runtime names it ("TPU v5p", ...; "cpu" on the CPU stand-in)."""
    return runtime.jax_device(_index(device)).device_kind


def get_device_properties(device: int | str | torch.device | None = None) -> DeviceProperties:
    """Name, platform and memory of a tpu device. A TPU reports its memory limit (UNTESTED: no
    TPU here); on the CPU stand-in device memory is host memory, so it is the host's."""
    index = _index(device)
    jax_device = runtime.jax_device(index)
    if jax_device.platform == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        stats = jax_device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise RuntimeError(f"tpu:{index} ({jax_device.device_kind}) reports no memory limit")
        total = int(stats["bytes_limit"])
    return DeviceProperties(jax_device.device_kind, jax_device.platform, index, total)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes `torch.autocast("tpu", dtype=...)` runs in (bfloat16, its default, and float16)."""
    return _autocast.supported_dtypes()


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """True: bfloat16 is the TPU's native 16-bit type (the CPU stand-in computes it too)."""
    return True


def precision(mode: str | Precision | None = None):
    """Matmul precision: `precision()` returns the mode, `precision(mode)` sets it and, used as
    `with torch.tpu.precision(mode):`, restores the previous mode on exit."""
    if mode is None:
        return _precision.get_mode()
    return _PrecisionSetting(mode)


class _PrecisionSetting:
    """Returned by `precision(mode)`: the mode is set at once; as a context manager the previous
    mode comes back on exit."""

    def __init__(self, mode: str | Precision) -> None:
        self._previous = _precision.get_mode()
        _precision.set_mode(mode.value if isinstance(mode, Precision) else mode)

    def __enter__(self) -> "_PrecisionSetting":
        return self

    def __exit__(self, *exc) -> None:
        _precision.set_mode(self._previous)


def _is_in_bad_fork() -> bool:
    return False


# --- registration -------------------------------------------------------------------------------


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return runtime.is_started()

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


_registered = False


def register_backend() -> None:
    """Rename PrivateUse1 to "tpu", install hooks, guard and the `torch.tpu` module (once)."""
    global _registered
    if _registered:
        return
    import sys

    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "tpu"):
        raise RuntimeError(
            f"PrivateUse1 is already taken by {torch._C._get_privateuse1_backend_name()!r}; "
            "torchtpu cannot register the tpu device"
        )
    # The C++ guard goes first: guard registration is first-wins (see `torchtpu.device_guard`).
    device_guard.install()
    device_guard.set_runtime(device_guard.RuntimeHooks(
        synchronize=synchronize, record_event=_events.record, query_event=_events.query,
        synchronize_event=_events.synchronize, destroy_event=_events.destroy, elapsed_time=_events.elapsed_time,
        memory_stats=_memory_stats,
        reset_peak_memory_stats=reset_peak_memory_stats, empty_cache=empty_cache, memory_info=mem_get_info,
    ))
    _setup_privateuseone_for_python_backend("tpu", sys.modules[__name__], _Hooks(), _Guard())
    _autocast.install()  # after the rename: it sets the autocast dtype of "tpu"
    _backward_on_calling_thread()
    _registered = True


def _backward_on_calling_thread() -> None:
    """Run backward passes on the thread that starts them, not on autograd's thread per device.

    PyTorch's autograd engine runs the backward of every non-CPU device on an engine thread of
    that device while the caller waits: for CUDA that thread keeps launching kernels while the
    caller is free, but tpu programs are dispatched asynchronously anyway, so the hand-off only
    adds two thread wake-ups to every backward (~0.2-0.3 ms a training step on a 2-core host: a
    small MLP compiled in defer mode, 1.24 -> 1.02 ms a step). The setting is PyTorch's own
    and per thread: this sets it in the thread that imports torchtpu (CPU backward passes run
    on the calling thread either way); `torch.autograd.set_multithreading_enabled(True)` brings
    the engine's threads back in a thread that wants them."""
    torch.autograd.set_multithreading_enabled(False)
