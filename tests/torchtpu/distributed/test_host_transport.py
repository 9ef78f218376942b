"""The host transport's buffers, in one process: inputs are views of device memory, results
become device memory without a copy, and a result buffer is reused only when nothing uses it."""

from __future__ import annotations

import gc

import numpy as np
import torch

from torchtpu.distributed.host_transport import ReceiveBuffers, host_view
from torchtpu.exec import memory


def _address(t: torch.Tensor) -> int:
    return memory.to_array(t).unsafe_buffer_pointer()


def test_host_view_of_a_whole_tensor_is_its_device_memory():
    t = torch.arange(6, dtype=torch.float32).to("tpu:0")
    view = host_view(t)
    assert view.data_ptr() == _address(t)
    assert view.tolist() == list(range(6))


def test_host_view_of_a_strided_view_has_its_values():
    base = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    view = host_view(base.to("tpu:0").t()[1:3])
    assert torch.equal(view, base.t()[1:3])


def test_a_result_becomes_device_memory_without_a_copy():
    buffers = ReceiveBuffers()
    out = torch.empty(5, dtype=torch.bfloat16, device="tpu:0")
    host = buffers.take((5,), torch.bfloat16)
    host.copy_(torch.arange(5))
    memory.move_from_host(out, host)
    assert _address(out) == host.data_ptr()
    assert out.cpu().tolist() == [0, 1, 2, 3, 4]


def test_a_buffer_is_reused_only_after_every_user_let_go():
    buffers = ReceiveBuffers()
    out = torch.empty(1024, device="tpu:0")
    first = buffers.take((1024,), torch.float32)
    first.fill_(1.0)
    memory.move_from_host(out, first)
    address = first.data_ptr()
    del first
    held = memory.to_numpy(out)  # a host view of the device buffer
    second = buffers.take((1024,), torch.float32)
    assert second.data_ptr() != address  # in use by `out`
    second.fill_(2.0)
    memory.move_from_host(out, second)  # `out` lets go of the first buffer ...
    del second
    gc.collect()
    third = buffers.take((1024,), torch.float32)
    assert third.data_ptr() != address  # ... but `held` still reads it
    assert np.all(held == 1.0)
    del held, third
    gc.collect()
    assert buffers.take((256, 4), torch.float32).data_ptr() == address  # free: reused
