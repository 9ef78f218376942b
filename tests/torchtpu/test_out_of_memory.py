"""Running out of tpu memory raises `torch.OutOfMemoryError` -- the class `torch.cuda.OutOfMemoryError`
and `torch.tpu.OutOfMemoryError` name -- from every executor and from the C++ fast path, caused by
the runtime's RESOURCE_EXHAUSTED error; the device keeps working afterwards. The reference is
torch.cuda's contract: code that catches its out-of-memory error catches this one."""

from __future__ import annotations

import jax
import pytest
import torch

import torchtpu
from torchtpu import out_of_memory
from torchtpu.exec import eager, fast_dispatch

# float32 elements: 256 TiB, more than a process can address (128 TiB of user space on x86-64 and
# arm64), so no host's overcommit policy lets the allocation through to be filled.
TOO_BIG = 2**46


def _still_works() -> None:
    assert (torch.ones(3, device="tpu") * 2).sum().item() == 6.0


def test_torch_tpu_names_torchs_out_of_memory_error():
    assert torch.tpu.OutOfMemoryError is torch.OutOfMemoryError is torch.cuda.OutOfMemoryError


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_an_op_too_big_for_the_device(mode):
    with torchtpu.eager_mode(mode):
        with pytest.raises(torch.cuda.OutOfMemoryError, match="tpu out of memory: RESOURCE_EXHAUSTED") as raised:
            (torch.zeros(TOO_BIG, device="tpu") + 1)[0].item()
        assert isinstance(raised.value.__cause__, jax.errors.JaxRuntimeError)
        _still_works()


def test_a_compiled_graph_too_big_for_the_device():
    graph = torch.compile(lambda a: (a + 1).expand(TOO_BIG // 4, 4).contiguous() * 2, backend="tpu")
    with pytest.raises(torch.tpu.OutOfMemoryError, match="RESOURCE_EXHAUSTED"):
        graph(torch.ones(4, device="tpu")).sum().item()
    _still_works()


def test_a_transfer_too_big_for_the_device(monkeypatch):
    """As the runtime reports a placement it has no room for (a 1 TiB host tensor cannot be made
    here to provoke it)."""
    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 12 bytes.")

    monkeypatch.setattr(jax, "device_put", exhausted)
    with pytest.raises(torch.OutOfMemoryError, match="RESOURCE_EXHAUSTED"):
        torch.ones(3).to("tpu")
    monkeypatch.undo()
    _still_works()


def test_other_runtime_errors_are_left_as_they_are():
    error = jax.errors.JaxRuntimeError("INVALID_ARGUMENT: not a memory problem")
    assert out_of_memory.as_torch(error) is error
    assert out_of_memory.as_torch(RuntimeError("RESOURCE_EXHAUSTED: not the runtime's")).__class__ is RuntimeError


class _Exhausting:
    """A program that runs until told to report that device memory ran out, counting its calls."""

    def __init__(self, jitted) -> None:
        self.jitted, self.exhausted, self.calls = jitted, False, 0

    def __call__(self, *args):
        self.calls += 1
        if self.exhausted:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 48 bytes.")
        return self.jitted(*args)


@pytest.fixture
def exhausting(monkeypatch):
    """Programs compiled from now on are `_Exhausting`; memory runs out once `exhaust()` is called.
    (A program that the fast path learned running out of memory later cannot be provoked on the
    stand-in: its host would have to fill up between two calls.)"""
    programs: list[_Exhausting] = []
    compile_program = eager._compile

    def compile_exhausting(call):
        exe = compile_program(call)
        exe.jitted = _Exhausting(exe.jitted)
        programs.append(exe.jitted)
        return exe

    monkeypatch.setattr(eager, "_compile", compile_exhausting)

    def exhaust() -> list[_Exhausting]:
        for program in programs:
            program.exhausted, program.calls = True, 0
        return programs

    yield exhaust
    eager.clear_cache()  # no exhausting program stays cached


@pytest.mark.skipif(not fast_dispatch.enabled(), reason="the fast path needs a C++ compiler")
def test_an_in_place_call_from_cpp_raises_it(exhausting):
    """The C++ kernel raises an in-place call's error itself (running it again would read a
    donated buffer): it makes it torch's too."""
    x = torch.randn(5, 7).to("tpu")  # a key of its own
    for _ in range(3):
        x.mul_(1.5)
    fast = torchtpu.metrics()["eager_fast_calls"]
    x.mul_(1.5)
    assert torchtpu.metrics()["eager_fast_calls"] == fast + 1  # the call runs from C++
    (program,) = exhausting()
    with pytest.raises(torch.OutOfMemoryError, match="RESOURCE_EXHAUSTED"):
        x.mul_(1.5)
    assert program.calls == 1  # raised from C++, not run again by the Python kernel


@pytest.mark.skipif(not fast_dispatch.enabled(), reason="the fast path needs a C++ compiler")
def test_a_compiled_graph_called_from_cpp_raises_it(exhausting):
    graph = torch.compile(lambda a, b: (a @ b).relu() + 1, backend="tpu")
    a, b = torch.randn(6, 3).to("tpu"), torch.randn(3, 2).to("tpu")
    for _ in range(3):
        graph(a, b)
    fast = torchtpu.metrics()["compiled_fast_calls"]
    graph(a, b)
    assert torchtpu.metrics()["compiled_fast_calls"] == fast + 1
    programs = exhausting()
    with pytest.raises(torch.OutOfMemoryError, match="RESOURCE_EXHAUSTED"):
        graph(a, b)
    assert sum(program.calls for program in programs) == 1
