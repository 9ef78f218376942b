"""One process per device, as on TPU.

A TPU chip is owned by one user-space process. The stand-in enforces the same rule so that
multi-process code which maps two ranks to one device fails here as it would on a TPU: the
first use of `tpu:i` takes an exclusive `flock` on a per-device lock file, which the kernel
releases when the process exits, also on a crash. The holder writes its pid and command line
into the file so that a second process can say who holds the device.

`TORCHTPU_DEVICE_LOCK=0` turns the lock off on the stand-in (never on a TPU).
`TORCHTPU_LOCK_DIR` chooses the directory (default: a per-user directory under the system
temporary directory); processes that use different directories behave as different hosts.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile

_held: dict[int, int] = {}


class DeviceBusyError(RuntimeError):
    """The device is held by another process."""


def _lock_dir() -> str:
    path = os.environ.get("TORCHTPU_LOCK_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchtpu-locks-{os.getuid()}"
    )
    os.makedirs(path, exist_ok=True)
    return path


def enabled(platform: str) -> bool:
    return platform == "tpu" or os.environ.get("TORCHTPU_DEVICE_LOCK", "1") != "0"


def acquire(index: int, platform: str) -> None:
    """Take the lock of device `index` for this process (idempotent)."""
    if index in _held or not enabled(platform):
        return
    path = os.path.join(_lock_dir(), f"{platform}-device-{index}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with open(path, encoding="utf-8", errors="replace") as f:
            holder = f.read().strip() or "an unknown process"
        os.close(fd)
        raise DeviceBusyError(
            f"tpu:{index} is already in use by {holder}. A TPU device is owned by one process: "
            f"give each process its own device (e.g. tpu:<local rank>)"
            + ("" if platform == "tpu" else ", or set TORCHTPU_DEVICE_LOCK=0 on the CPU stand-in")
            + f". Lock file: {path}"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} ({' '.join(sys.argv) or sys.executable})".encode())
    _held[index] = fd


def held() -> tuple[int, ...]:
    """Device indices this process holds."""
    return tuple(sorted(_held))


def _forget_after_fork() -> None:
    # A forked child does not own its parent's devices (flock is shared through the inherited
    # descriptor, so close it without unlocking the parent's lock).
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
