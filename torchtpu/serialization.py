"""`torch.save` / `torch.load` of `tpu` tensors.

Saving needs nothing special (PyTorch copies each storage to the host). Loading a storage saved
from `tpu` (without `map_location`, or with a tpu one) cannot go through PyTorch's default path,
which allocates device memory from C++ (there is no C++ allocator for this Python backend). The
deserializer registered here puts the saved bytes on the device as an untyped `DeviceBuffer`; the
first tensor rebuilt on it gives the bytes their element type.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from torchtpu import storage

_LOCATION = re.compile(r"^tpu(:(\d+))?$")


def _tag(obj) -> str | None:
    if obj.device.type == "tpu":
        return f"tpu:{obj.device.index or 0}"
    return None


def _deserialize(obj, location: str):
    match = _LOCATION.match(location)
    if match is None:
        return None
    from torchtpu.device import current_device
    from torchtpu.exec.memory import host_to_device

    index = int(match.group(2)) if match.group(2) is not None else current_device()
    if obj.device.type != "cpu":
        obj = obj.cpu()
    data = np.frombuffer(bytes(obj), dtype=np.uint8) if obj.nbytes() else np.zeros(0, np.uint8)
    buffer = storage.DeviceBuffer(torch.uint8, data.size, index, host_to_device(data, index), untyped=True)
    return storage.new_storage(buffer)


def register() -> None:
    torch.serialization.register_package(19, _tag, _deserialize)
