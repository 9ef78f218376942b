"""The host transport's buffers, in one process: inputs are views of device memory, results
become device memory without a copy, a result buffer or pooled result array is reused only when
nothing uses it, and a claimed output is written in its own buffer only when no one else can see
that memory."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import torchtpu
from torchtpu import storage
from torchtpu.distributed.host_transport import (
    ReceiveBuffers,
    ResultArrays,
    _borrowed,
    _claimed,
    _Staging,
    claim,
    host_view,
)
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


def test_a_claimed_tensor_is_written_in_its_own_buffer_seen_by_its_views():
    t = torch.arange(8, dtype=torch.float32).to("tpu:0")
    view = t[2:5]
    claim(t)  # the first claim may copy (the buffer came from the host); later ones alias
    host = claim(t)
    assert host is not None and host.data_ptr() == _address(t)
    host.copy_(-torch.arange(8, dtype=torch.float32))
    del host
    assert t.cpu().tolist() == [-float(i) for i in range(8)]
    assert view.cpu().tolist() == [-2.0, -3.0, -4.0]


def test_a_claim_never_writes_memory_that_a_host_view_still_reads():
    t = torch.arange(4, dtype=torch.int64).to("tpu:0")
    claim(t)
    held = host_view(t)
    host = claim(t)
    assert host is not None and host.data_ptr() != held.data_ptr()
    host.fill_(9)
    assert held.tolist() == [0, 1, 2, 3]
    assert t.cpu().tolist() == [9, 9, 9, 9]


def test_a_claim_waits_for_programs_still_reading_the_buffer():
    t = torch.ones(1 << 20).to("tpu:0")
    claim(t)
    total = (t * 2).sum()  # dispatched asynchronously: may still be reading `t`
    host = claim(t)
    host.zero_()
    del host
    assert total.item() == 2.0 * (1 << 20)


def test_only_whole_tensors_whose_buffer_nothing_else_holds_are_claimed():
    base = torch.arange(6, dtype=torch.float32).to("tpu:0")
    assert claim(base[1:]) is None  # a view of part of its storage
    held = memory.to_array(base)  # another holder of the buffer
    assert claim(base) is None
    del held
    assert claim(base) is not None
    assert claim(torch.empty(3, device="tpu:0")) is None  # never written: no buffer to claim


def test_what_gloo_holds_does_not_keep_a_claimed_buffer_exported():
    t = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4).to("tpu:0")
    claim(t)
    host = claim(t)
    lent = _borrowed(host)
    assert lent.data_ptr() == host.data_ptr() and lent.dtype == host.dtype and torch.equal(lent, host)
    del host  # the transport lets go once gloo is done; gloo may hold `lent` a while longer
    again = claim(t)
    assert again is not None and again.data_ptr() == lent.data_ptr()  # aliased, not copied


def test_a_never_written_output_is_received_without_reading_it(monkeypatch):
    # A fresh `torch.empty` (what TorchRec's all-to-alls write into every step) has no device
    # buffer yet: reading it would make one of zeros, only to have it replaced.
    out = torch.empty(2, 3, device="tpu:0")
    reads = []
    monkeypatch.setattr(memory, "to_array", lambda t: reads.append(t) or pytest.fail("read a never-written output"))
    staging = _Staging(ReceiveBuffers())
    host = staging.receive(out)
    host.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    staging.deliver()
    monkeypatch.undo()
    assert not reads
    assert out.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def _received(out: torch.Tensor, value: torch.Tensor, results: ResultArrays) -> int:
    """Receive `value` into `out` as a collective does (gloo's part played by a copy); the
    address gloo wrote."""
    staging = _Staging(ReceiveBuffers(), results)
    host = staging.receive(out)
    host.copy_(value)
    staging.deliver()
    return host.data_ptr()


def _reused() -> int:
    return torchtpu.metrics().get("dist_results_reused", 0)


def test_a_new_output_receives_into_a_pooled_array_reused_once_the_output_is_gone():
    results = ResultArrays(recurring=1)
    out = torch.empty(4, 3, device="tpu:0")
    written = _received(out, torch.arange(12.0).reshape(4, 3), results)
    assert _address(out) == written  # gloo wrote the output's own device buffer
    assert out.cpu().tolist() == torch.arange(12.0).reshape(4, 3).tolist()
    del out
    before = _reused()
    again = torch.empty(2, 6, device="tpu:0")  # another shape of as many elements
    reused = _received(again, -torch.ones(2, 6), results)  # JAX copies an imported buffer once ...
    assert _address(again) == reused
    assert again.cpu().tolist() == (-torch.ones(2, 6)).tolist()
    del again
    third = torch.empty(12, device="tpu:0")
    assert _received(third, torch.ones(12), results) == reused  # ... and from then on aliases it
    assert _reused() == before + 2
    assert third.cpu().tolist() == [1.0] * 12


def test_a_pooled_array_is_never_written_while_anything_still_reads_it():
    results = ResultArrays(per_size=8, recurring=1)
    n = 1 << 20

    def new(value: float) -> torch.Tensor:
        out = torch.empty(n, device="tpu:0")
        _received(out, torch.full((n,), value), results)
        return out

    view = new(1.0)[10:20]  # a view keeps its storage, and so the array
    held = memory.to_numpy(new(2.0))  # a host view of a buffer whose output is gone
    out = new(3.0)
    total = (out * 2).sum()  # dispatched asynchronously: may still be reading the array
    del out
    for value in (4.0, 5.0, 6.0):
        new(value)  # reuses what it may, and overwrites it
    assert view.cpu().tolist() == [1.0] * 10
    assert np.all(held == 2.0)
    assert total.item() == 6.0 * n


def test_an_array_a_program_took_leaves_the_pool():
    results = ResultArrays(recurring=1)
    with torchtpu.eager_mode("strict"):  # in place, a program takes (donates) its input's buffer
        out = torch.empty(6, device="tpu:0")
        _received(out, torch.arange(6.0), results)
        out.add_(1)
        assert out.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        del out
        again = torch.empty(6, device="tpu:0")
        _received(again, torch.ones(6), results)
        assert again.cpu().tolist() == [1.0] * 6


def test_an_output_holding_a_pooled_array_is_claimed_only_where_the_pool_is_known():
    results = ResultArrays(recurring=1)
    out = torch.empty(8, device="tpu:0")
    _received(out, torch.arange(8.0), results)
    assert claim(out) is None  # for a caller unaware of the pool, it holds the array too
    assert _claimed(out, storage.buffer_of(out), results) is not None
    assert out.cpu().tolist() == list(map(float, range(8)))


def test_the_pool_keeps_at_most_its_bounds():
    results = ResultArrays(per_size=1, max_bytes=1 << 11, recurring=1)
    first, second = torch.empty(256, device="tpu:0"), torch.empty(256, device="tpu:0")
    a = _received(first, torch.zeros(256), results)
    b = _received(second, torch.ones(256), results)  # the pooled array is in use: a new one, not pooled
    assert a != b
    del first, second
    gc.collect()
    before = _reused()
    third = torch.empty(256, device="tpu:0")
    _received(third, torch.ones(256), results)
    assert _reused() == before + 1
    small = torch.empty(512, device="tpu:0")  # a second size goes over max_bytes: the first is forgotten
    _received(small, torch.zeros(512), results)
    del third
    fourth = torch.empty(256, device="tpu:0")
    _received(fourth, torch.ones(256), results)
    assert _reused() == before + 1


def test_only_sizes_that_recur_are_pooled():
    results = ResultArrays()  # a size is pooled once asked for a third time

    def received_and_gone() -> int:
        before = _reused()
        _received(torch.empty(32, device="tpu:0"), torch.ones(32), results)
        gc.collect()
        return _reused() - before

    assert [received_and_gone() for _ in range(5)] == [0, 0, 0, 1, 1]


def _pending_product() -> torch.Tensor:
    """A tpu tensor whose program (~0.1 s of matmuls) is still running when this returns; every
    element is exactly 1/1024 (powers of two are exact at any matmul precision)."""
    a = torch.full((1024, 1024), 1.0 / 1024).to("tpu:0")
    product = (a @ a @ a @ a @ a).reshape(-1)
    assert not memory.to_array(product).is_ready()  # else the tests below would test nothing
    return product


def test_gloo_reads_an_input_only_once_the_program_writing_it_finished():
    product = _pending_product()
    staging = _Staging(ReceiveBuffers())
    lent = staging.read(product)
    assert torch.equal(lent, torch.full((1 << 20,), 1.0 / 1024))
    staging.deliver()


def test_gloo_writes_a_claimed_output_only_once_the_program_writing_it_finished():
    product = _pending_product()
    staging = _Staging(ReceiveBuffers())
    lent = staging.update(product)  # what an all_reduce gives gloo, to reduce in place
    assert torch.equal(lent, torch.full((1 << 20,), 1.0 / 1024))
    lent.fill_(7.0)
    staging.deliver()
    assert torch.equal(product.cpu(), torch.full((1 << 20,), 7.0))
