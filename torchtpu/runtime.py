"""The PJRT runtime behind the `tpu` device: which JAX devices back `tpu:0..N-1`.

JAX is the PJRT client on these machines. The TPU platform is used where present; otherwise
JAX's CPU platform stands in, with `TORCHTPU_NUM_DEVICES` virtual devices (default 1). The
runtime starts lazily, on first use of a device, so `import torch` (which autoloads this
backend) stays cheap and the device count can still be chosen before it starts.

`ON_TPU` is the one switch for code that only a real TPU can run (native matmul precision,
SparseCore custom calls, XLA collectives across chips). Everything behind it is untested
here: there is no TPU on the development machines.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtpu import device_guard, device_lock, stand_in_memory

if TYPE_CHECKING:
    import jax

_NUM_DEVICES_ENV = "TORCHTPU_NUM_DEVICES"
_FORCE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_POOL_SIZE_ENV = "NPROC"  # XLA:CPU's thread pool size (default: the host's cores, at least one per device)


class RuntimeConfigError(RuntimeError):
    """The runtime cannot honour its configuration (for example, set after it started)."""


@dataclass(frozen=True)
class Runtime:
    """The started runtime: the platform and the JAX devices that back `tpu:i` (this process's
    devices), and, in a multi-process job, the process's place in the global JAX runtime."""

    platform: str
    devices: tuple["jax.Device", ...]
    process_index: int = 0
    process_count: int = 1

    @property
    def on_tpu(self) -> bool:
        return self.platform == "tpu"

    @property
    def device_memory_is_host(self) -> bool:
        """Device buffers live in host memory (the CPU stand-in): a host view of one needs no copy."""
        return self.platform == "cpu"


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process JAX runtime (multi-controller): the coordinator's
    address, the number of processes and this process's id. Programs over devices of several
    processes (the SparseCore kernels of a sharded embedding) then run with XLA collectives
    between processes -- over gloo on the CPU stand-in, over ICI/DCN on TPU."""

    coordinator_address: str
    num_processes: int
    process_id: int


_runtime: Runtime | None = None
_distributed: DistributedConfig | None = None
_lock = threading.Lock()


def configure_distributed(config: DistributedConfig) -> None:
    """Join a multi-process JAX runtime when the runtime starts (call before first device use;
    the `tpu_dist` process group does it when it is created)."""
    global _distributed
    with _lock:
        if _runtime is not None:
            if _distributed == config or config.num_processes == 1:
                return
            raise RuntimeConfigError(
                "the tpu runtime already started in single-process mode, so this process cannot join "
                f"the {config.num_processes}-process job: call torch.distributed.init_process_group("
                "'tpu_dist' ...) before creating tpu tensors"
            )
        _distributed = config


def configure_distributed_from_store(store, rank: int, size: int, key: str) -> None:
    """`configure_distributed` for a torch.distributed job: rank 0 publishes the coordinator
    address (its MASTER_ADDR, or its host name, and a free port) under `key` in torch's `store`,
    which every rank reads (any launcher that gives torch a store works)."""
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        store.set(key, f"{os.environ.get('MASTER_ADDR') or socket.getfqdn()}:{port}")
    configure_distributed(DistributedConfig(store.get(key).decode(), size, rank))


def _requested_device_count() -> int | None:
    value = os.environ.get(_NUM_DEVICES_ENV)
    if value is None or value == "":
        return None
    try:
        count = int(value)
    except ValueError:
        raise RuntimeConfigError(f"{_NUM_DEVICES_ENV}={value!r} is not an integer") from None
    if count < 1:
        raise RuntimeConfigError(f"{_NUM_DEVICES_ENV}={count} must be at least 1")
    return count


def _forced_host_device_count() -> int | None:
    match = re.search(_FORCE_COUNT_FLAG + r"=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(match.group(1)) if match else None


def stand_in_pool_size(devices: int, processes: int = 1) -> int | None:
    """The thread pool XLA:CPU needs so that the stand-in's collectives do not starve; None where
    no program spans devices (one device, one process).

    XLA:CPU (xla/pjrt/cpu/cpu_client.cc) runs every device's programs on one pool of
    max(cores, devices) threads. A program spanning devices runs one part per device, all holding
    a thread at once while they meet in a collective; launching one schedules a task per device
    that waits, holding a thread, while its device already has its limit of programs in flight;
    and each device's own programs need threads too. With one thread per device, two independent
    chains of collective programs launched from one thread deadlocked within seconds on 4 devices
    (XLA aborts after 40 s: "Termination timeout for `all reduce ...`"); 8 threads were enough.
    The pool gets twice that: devices x 4. (Programs spanning devices launched from two threads
    at once can deadlock whatever the pool: `sharding.from_jax`, which the prefetching loader
    runs, launches none.) A real TPU runs its programs on its chips, not on a host pool."""
    if devices * processes < 2:
        return None
    return max(os.cpu_count() or 1, 4 * devices)


def _configure_host_platform(requested: int | None) -> None:
    """Ask XLA for enough virtual CPU devices, and a thread pool they can run collectives on
    (`stand_in_pool_size`), before the JAX backends start."""
    from jax._src import xla_bridge

    forced = _forced_host_device_count()
    want = requested or 1
    if xla_bridge.backends_are_initialized():
        return
    if forced is None:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {_FORCE_COUNT_FLAG}={want}".strip()
    elif forced < want:
        os.environ["XLA_FLAGS"] = re.sub(
            _FORCE_COUNT_FLAG + r"=\d+", f"{_FORCE_COUNT_FLAG}={want}", os.environ["XLA_FLAGS"]
        )
    processes = _distributed.num_processes if _distributed is not None else 1
    pool = stand_in_pool_size(max(forced or 0, want), processes)
    if pool is not None:
        given = os.environ.get(_POOL_SIZE_ENV, "")
        if not given.isdigit() or int(given) < pool:
            os.environ[_POOL_SIZE_ENV] = str(pool)


def _join_distributed() -> tuple[int, int]:
    import jax

    config = _distributed
    if config is None or config.num_processes == 1:
        return 0, 1
    # The CPU stand-in runs cross-process collectives over gloo (XLA's CPU default has none).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
    )
    return config.process_id, config.num_processes


def _start() -> Runtime:
    requested = _requested_device_count()
    _configure_host_platform(requested)
    # Before JAX starts its threads: the stand-in's device memory is host memory.
    stand_in_memory.install()
    import jax

    jax.config.update("jax_enable_x64", True)
    process_index, process_count = _join_distributed()
    try:
        tpus = jax.local_devices(backend="tpu")
    except RuntimeError:
        tpus = []
    if tpus:
        # UNTESTED (no TPU here): device memory is the TPU's own.
        stand_in_memory.uninstall()
        devices = tuple(tpus[:requested] if requested else tpus)
        return Runtime("tpu", devices, process_index, process_count)
    cpus = jax.local_devices(backend="cpu")
    want = requested or 1
    if len(cpus) < want:
        raise RuntimeConfigError(
            f"{_NUM_DEVICES_ENV}={want} asks for {want} stand-in devices, but the JAX CPU backend "
            f"already started with {len(cpus)}. Set {_NUM_DEVICES_ENV} (or XLA_FLAGS="
            f"{_FORCE_COUNT_FLAG}={want}) before anything uses jax or the tpu device."
        )
    return Runtime("cpu", tuple(cpus[:want]), process_index, process_count)


def runtime() -> Runtime:
    """The runtime, started on first call."""
    global _runtime
    if _runtime is None:
        with _lock:
            if _runtime is None:
                _runtime = _start()
                device_guard.set_device_count(len(_runtime.devices))
    return _runtime


def is_started() -> bool:
    return _runtime is not None


def device_count() -> int:
    return len(runtime().devices)


def jax_device(index: int) -> "jax.Device":
    """The JAX device behind `tpu:index`; takes the device's process lock on first use."""
    devices = runtime().devices
    if not 0 <= index < len(devices):
        raise RuntimeError(
            f"tpu:{index} does not exist: this process has {len(devices)} tpu device(s) "
            f"(set {_NUM_DEVICES_ENV} before first use to change the stand-in count)"
        )
    device_lock.acquire(index, runtime().platform)
    return devices[index]


def check_device_count_env() -> None:
    """Raise if `TORCHTPU_NUM_DEVICES` changed after the runtime started (set too late)."""
    if _runtime is None:
        return
    requested = _requested_device_count()
    if requested is not None and _runtime.platform == "cpu" and requested != len(_runtime.devices):
        raise RuntimeConfigError(
            f"{_NUM_DEVICES_ENV}={requested} was set after the tpu runtime started with "
            f"{len(_runtime.devices)} device(s); set it before the first use of the device"
        )
