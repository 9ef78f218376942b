"""`torch.tpu` streams: each device's one queue, under the API that device-agnostic code written
for CUDA streams calls (`torch.get_device_module(device).current_stream()`, `stream(...)`)."""

from __future__ import annotations

import pytest
import torch


def test_current_and_default_stream_are_the_device_queue():
    module = torch.get_device_module(torch.device("tpu"))
    assert module.current_stream() == torch.tpu.default_stream() == torch.tpu.Stream()
    assert torch.tpu.current_stream().device == torch.device("tpu", torch.tpu.current_device())
    assert torch.tpu.current_stream(1) == torch.tpu.Stream("tpu:1") != torch.tpu.current_stream(0)
    assert torch.tpu.current_stream(1).device_type == "tpu"


def test_stream_context_makes_its_device_current():
    before = torch.tpu.current_device()
    with torch.tpu.stream(torch.tpu.Stream(1)):
        assert torch.tpu.current_device() == 1
        assert torch.ones(2, device="tpu").device == torch.device("tpu:1")
    assert torch.tpu.current_device() == before
    with torch.tpu.stream(None):
        assert torch.tpu.current_device() == before


def test_synchronize_and_wait_stream():
    stream = torch.tpu.current_stream()
    x = torch.arange(6.0).reshape(2, 3)
    y = x.to("tpu") @ x.to("tpu").T
    stream.wait_stream(torch.tpu.Stream())
    stream.synchronize()
    torch.testing.assert_close(y.cpu(), x @ x.T)


def test_bad_arguments():
    with pytest.raises(ValueError, match="a stream of tpu:0 cannot wait for a stream of tpu:1"):
        torch.tpu.Stream(0).wait_stream(torch.tpu.Stream(1))
    with pytest.raises(TypeError, match="expects a torch.tpu.Stream"):
        torch.tpu.Stream(0).wait_stream(torch.cpu.Stream())
    with pytest.raises(TypeError, match="expects a torch.tpu.Stream or None"):
        with torch.tpu.stream(torch.cpu.Stream()):
            pass
