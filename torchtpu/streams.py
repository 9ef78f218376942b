"""`torch.tpu` streams: each device's one in-order queue, for code written against CUDA streams.

A tpu device runs what is issued to it in issue order (one PJRT queue per device; in defer mode,
in the order the fused programs are flushed). There is no second queue to overlap work on, so
every stream of a device stands for that queue: `current_stream()` and `default_stream()` return
it, `Stream()` names it again, `wait_stream` has nothing to order, and `synchronize()` waits for
everything issued to the device (`torch.tpu.synchronize`). Device-agnostic code that asks for
streams -- DCP's copy-ahead writer, TorchRec's train pipelines -- then runs its stages in order
instead of overlapped.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["Stream", "StreamContext", "current_stream", "default_stream", "set_stream", "stream"]


class Stream(torch.Stream):
    """The queue of tpu device `device` (default: the current device): a `torch.Stream`, so
    `Tensor.record_stream` and `torch.Event.wait`/`record` take it. `priority` is accepted for
    CUDA-style callers; one queue has no priorities."""

    device_type = "tpu"

    def __new__(cls, device: int | str | torch.device | None = None, priority: int = 0) -> Stream:
        from torchtpu import device as tpu

        return super().__new__(cls, device=torch.device("tpu", tpu._index(device)), priority=priority)

    def __init__(self, device: int | str | torch.device | None = None, priority: int = 0) -> None:
        self.priority = priority

    def synchronize(self) -> None:
        """Wait until everything issued to the device has finished."""
        from torchtpu import device as tpu

        tpu.synchronize(self.device)

    def wait_stream(self, stream: torch.Stream) -> None:
        """Order this stream after `stream`: already so on one device's queue. Streams of two
        devices have no order between them, so that is an error."""
        _check_is_tpu_stream("wait_stream", stream)
        if stream.device != self.device:
            raise ValueError(f"a stream of {self.device} cannot wait for a stream of {stream.device}")

    def __repr__(self) -> str:
        return f"torch.tpu.Stream(device={self.device})"


def _check_is_tpu_stream(caller: str, stream: object) -> None:
    if not isinstance(stream, torch.Stream) or stream.device.type != "tpu":
        raise TypeError(f"{caller} expects a torch.tpu.Stream (or another tpu torch.Stream), got {stream!r}")


def current_stream(device: int | str | torch.device | None = None) -> Stream:
    """The queue of `device` (default: the current tpu device)."""
    return Stream(device)


def default_stream(device: int | str | torch.device | None = None) -> Stream:
    """The queue of `device`: the same stream as `current_stream`."""
    return Stream(device)


class StreamContext:
    """Context manager that issues the block's work to `stream`: its device's one queue, where it
    goes anyway; makes the stream's device current meanwhile and restores the previous one, as
    CUDA's does. `None` changes nothing."""

    def __init__(self, stream: Stream | None) -> None:
        if stream is not None:
            _check_is_tpu_stream("torch.tpu.stream", stream)
        self.stream = stream
        self._on_device: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> None:
        if self.stream is not None:
            from torchtpu import device as tpu

            self._on_device = tpu.device(self.stream.device)
            self._on_device.__enter__()

    def __exit__(self, *exc_info) -> None:
        if self._on_device is not None:
            on_device, self._on_device = self._on_device, None
            on_device.__exit__(*exc_info)


def stream(stream: Stream | None) -> StreamContext:
    """`with torch.tpu.stream(s):` issues the block's work to `s` (`StreamContext`)."""
    return StreamContext(stream)


def set_stream(stream: Stream | None) -> None:
    """Make `stream` current: its device becomes the current device (a device has one queue), as
    `torch.cuda.set_stream` makes the stream's device current. `None` changes nothing."""
    if stream is None:
        return
    _check_is_tpu_stream("torch.tpu.set_stream", stream)
    from torchtpu import device as tpu

    tpu.set_device(stream.device)
