"""`torch._assert_async` on tpu: a device-side check, raised with PyTorch's message at the next
synchronisation, in every eager mode and inside compiled graphs (`F.one_hot`'s decomposition
asserts its class values with it)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.exec.checks import DeviceCheckError

from cpu_reference import strict_ops  # noqa: F401

aten = torch.ops.aten


def _cpu_message(fn, *args) -> str:
    """The error PyTorch's CPU kernel raises for `fn(*args)` (the reference message)."""
    with pytest.raises(RuntimeError) as raised:
        fn(*args)
    return str(raised.value)


ASSERTS = {
    "msg": lambda cond: torch._assert_async(cond, "the condition was false"),
    "default": lambda cond: torch._assert_async(cond),
}


@pytest.mark.parametrize("mode", ["strict", "debug", "defer"])
@pytest.mark.parametrize("form", list(ASSERTS))
@pytest.mark.parametrize("false", [torch.tensor(False), torch.tensor(0.0), torch.tensor([0])])
def test_a_false_condition_raises_pytorchs_message_at_the_next_sync(mode, form, false):
    assert_ = ASSERTS[form]
    message = _cpu_message(assert_, false)
    x = torch.arange(3.0).to("tpu")
    with torchtpu.eager_mode(mode):
        assert_(torch.tensor(True).to("tpu"))
        assert_(torch.tensor([2.5]).to("tpu"))
        assert_((x + 1).min())  # computed on the device: the host never reads it
        torch.tpu.synchronize()
        with pytest.raises(DeviceCheckError, match=f"aten._assert_async.{form}: {message}"):
            assert_(false.to("tpu"))  # debug mode raises here, the others at the sync
            torch.tpu.synchronize()
    assert x.cpu().tolist() == [0.0, 1.0, 2.0]  # reported once; work goes on


@pytest.mark.parametrize("cond", [torch.tensor([1, 1]), torch.tensor([], dtype=torch.bool)])
def test_a_condition_of_other_than_one_value_raises_at_once_as_on_cpu(cond):
    message = _cpu_message(torch._assert_async, cond)
    with pytest.raises(RuntimeError, match=message):
        torch._assert_async(cond.to("tpu"))


def test_the_functional_form_threads_its_token():
    token = aten._make_dep_token(device="tpu")
    assert token.device.type == "tpu" and token.shape == aten._make_dep_token().shape
    token = aten._functional_assert_async.msg(torch.tensor(1).to("tpu"), "never", token)
    assert token.device.type == "tpu"
    torch.tpu.synchronize()
    aten._functional_assert_async.msg(torch.tensor(0).to("tpu"), "token check", token)
    with pytest.raises(DeviceCheckError, match="token check"):
        torch.tpu.synchronize()


def test_compiled_one_hot_runs_on_the_device_and_checks_its_classes():
    torchtpu.reset_metrics()
    classes = torch.tensor([[0, 3], [2, 1]])
    def doubled_one_hot(t, n):
        return F.one_hot(t, n) * 2

    fn = torch.compile(doubled_one_hot, backend="tpu", dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a lowering would warn
        torch.testing.assert_close(fn(classes.to("tpu"), 4).cpu(), F.one_hot(classes, 4) * 2, rtol=0, atol=0)
    assert "compiled_graphs_split" not in torchtpu.metrics()
    message = _cpu_message(doubled_one_hot, classes, 3)
    fn(classes.to("tpu"), 3)
    with pytest.raises(DeviceCheckError, match=message.split(": ")[-1]):
        torch.tpu.synchronize()
