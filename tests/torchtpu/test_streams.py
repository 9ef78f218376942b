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
    with pytest.raises(TypeError, match="torch.tpu.stream expects a torch.tpu.Stream"):
        with torch.tpu.stream(torch.cpu.Stream()):
            pass


def _pending_product() -> torch.Tensor:
    """A tpu tensor whose program (~0.3 s of matmuls) is still running when this returns; every
    element is exactly 1/2048 (powers of two are exact at any matmul precision)."""
    from torchtpu.exec import memory

    a = torch.full((2048, 2048), 1.0 / 2048).to("tpu:0")
    product = a @ a @ a
    assert not memory.to_array(product).is_ready()  # else the tests below would test nothing
    return product


@pytest.mark.parametrize("make", [lambda: torch.Event(device="tpu"), lambda: torch.tpu.Event()])
def test_an_event_completes_once_the_work_issued_before_it_has(make):
    from torchtpu.exec import memory

    event = make()
    assert event.query()  # never recorded
    event.record()  # once on an idle device: its first call's costs would outlast the product
    event.synchronize()
    torch.ones(2, device="tpu:0")  # compiled now, so that issuing it below takes no time
    product = _pending_product()
    event.record()
    later = torch.ones(2, device="tpu:0")  # issued after the record: not waited for
    assert not event.query()
    event.synchronize()
    assert event.query() and memory.to_array(product).is_ready()
    assert later.cpu().tolist() == [1.0, 1.0]


def test_an_event_reports_a_device_side_error():
    from torchtpu.exec.checks import DeviceCheckError

    torch.arange(4.0).to("tpu:0")[torch.tensor([1, 4]).to("tpu:0")]  # out of range: found on the device
    event = torch.tpu.Event(enable_timing=True)
    event.record()
    with pytest.raises(RuntimeError, match=f"{DeviceCheckError.__name__}: .*index out of range"):
        event.synchronize()


@pytest.mark.parametrize("make", [lambda: torch.Event(device="tpu", enable_timing=True),
                                  lambda: torch.tpu.Event(enable_timing=True)])
def test_elapsed_time_times_the_device_work_between_two_events(make):
    """The end event is stamped when the work issued before it finished, not when it was
    recorded: the product below is still running at the record, so the time between the two
    events includes the wait for it (as on CUDA, where the stamps are the device's)."""
    import time

    start, end = make(), make()
    start.record()
    start.synchronize()
    torch.ones(2, device="tpu:0")  # compiled now, so that issuing it below takes no time
    host_start = time.perf_counter()
    start.record()  # nothing pending: stamped at the record
    product = _pending_product()
    end.record()
    recorded = time.perf_counter()
    end.synchronize()
    finished = time.perf_counter()
    assert product.cpu().unique().tolist() == [1.0 / 2048]
    elapsed = start.elapsed_time(end)  # milliseconds
    still_running = (finished - recorded) * 1e3
    assert still_running > 20, "the product finished right after the record: too little to tell apart"
    assert (recorded - host_start) * 1e3 + 0.8 * still_running < elapsed
    assert elapsed < (finished - host_start) * 1e3 + 50  # the clock's thread stamps promptly (GIL allowing)


def test_a_devices_timing_waits_for_no_other_device():
    """Each device is a queue of its own: events timed on tpu:0 are stamped while tpu:1 still
    runs a product recorded before them."""
    a = torch.full((2048, 2048), 1.0 / 2048).to("tpu:1")
    (a @ a).cpu()  # compiled now
    x = torch.ones(4, device="tpu:0")
    (x + 1).cpu()
    other = torch.Event(device="tpu:1", enable_timing=True)
    product = a @ a @ a @ a
    other.record(torch.tpu.current_stream(1))
    start, end = (torch.Event(device="tpu:0", enable_timing=True) for _ in range(2))
    start.record(torch.tpu.current_stream(0))
    x + 1
    end.record(torch.tpu.current_stream(0))
    assert start.elapsed_time(end) < 50
    assert not other.query(), "tpu:1 finished first: nothing to tell apart"
    other.synchronize()
    assert product.cpu().unique().tolist() == [1.0 / 2048]


def test_elapsed_time_needs_two_recorded_timing_events():
    timed, untimed = torch.tpu.Event(enable_timing=True), torch.tpu.Event()
    timed.record()
    untimed.record()
    with pytest.raises(ValueError, match="enable_timing=True"):
        timed.elapsed_time(untimed)
    with pytest.raises(ValueError, match="must be recorded"):
        timed.elapsed_time(torch.tpu.Event(enable_timing=True))
    later = torch.tpu.Event(enable_timing=True)
    later.record()
    assert 0 <= timed.elapsed_time(later) < 1000


def test_torch_tpu_streams_are_torch_streams():
    stream = torch.tpu.current_stream()
    assert isinstance(stream, torch.Stream) and stream == torch.accelerator.current_stream()
    x = torch.ones(3, device="tpu")
    x.record_stream(stream)  # as code written for CUDA streams calls it
    stream.wait_stream(torch.Stream(device="tpu"))
    with torch.tpu.stream(torch.accelerator.current_stream()):
        assert x.cpu().tolist() == [1.0, 1.0, 1.0]


def test_torch_streams_of_tpu_are_the_device_queue():
    stream = torch.Stream(device="tpu")
    assert stream == torch.accelerator.current_stream() and stream.device_index == torch.tpu.current_device()
    assert stream.query()  # an idle device (and the query's first-call costs paid)
    product = _pending_product()
    assert not stream.query()
    stream.synchronize()
    assert stream.query()
    product.record_stream(stream)  # nothing to record: buffers outlive the programs reading them
    stream.wait_event(torch.Event(device="tpu"))
    torch.testing.assert_close(product.cpu(), torch.full((2048, 2048), 1.0 / 2048))


def test_set_stream_and_device_of_make_a_device_current_as_cudas_do():
    before = torch.tpu.current_device()
    try:
        torch.tpu.set_stream(torch.tpu.Stream(2))
        assert torch.tpu.current_device() == 2 and torch.tpu.current_stream() == torch.tpu.Stream(2)
        torch.tpu.set_stream(None)
        assert torch.tpu.current_device() == 2
        with torch.tpu.StreamContext(torch.tpu.Stream(1)):
            assert torch.tpu.current_device() == 1
        assert torch.tpu.current_device() == 2
        with torch.tpu.device_of(torch.ones(1, device="tpu:3")):
            assert torch.tpu.current_device() == 3
        with torch.tpu.device_of(torch.ones(1)):  # not a tpu tensor: nothing changes
            assert torch.tpu.current_device() == 2
        assert torch.tpu.current_device() == 2
        with pytest.raises(TypeError, match="torch.tpu.set_stream expects a torch.tpu.Stream"):
            torch.tpu.set_stream(torch.cpu.Stream())
    finally:
        torch.tpu.set_device(before)
