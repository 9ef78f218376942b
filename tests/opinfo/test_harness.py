"""The harness can fail: wrong values, dtypes, shapes, devices and structures are caught."""

import copy

import pytest
import torch

from . import harness

TOL = dict(override=(0.0, 0.0), where="case")


def test_compare_catches_each_kind_of_difference():
    expected = torch.tensor([1.0, 2.0])
    on_device = expected.to(harness.DEVICE)
    harness.compare(on_device, expected, **TOL)
    with pytest.raises(harness.Mismatch, match="not close"):
        harness.compare(on_device + 1e-3, expected, **TOL)
    with pytest.raises(harness.Mismatch, match="dtype"):
        harness.compare(on_device.double(), expected, **TOL)
    with pytest.raises(harness.Mismatch, match="expected it on tpu"):
        harness.compare(expected.clone(), expected, **TOL)
    with pytest.raises(harness.Mismatch, match="structure"):
        harness.compare((on_device,), [expected], **TOL)
    with pytest.raises(harness.Mismatch, match="got 3"):
        harness.compare(3, 4, **TOL)


def test_compare_without_values_still_checks_dtype_and_shape():
    expected = torch.zeros(2, 3)
    harness.compare(torch.ones(2, 3, device=harness.DEVICE), expected, **TOL, values=False)
    with pytest.raises(harness.Mismatch, match=r"\[3, 2\]"):
        harness.compare(torch.ones(3, 2, device=harness.DEVICE), expected, **TOL, values=False)


def _broken(name, op):
    opinfo = copy.copy(harness.entries()[name])
    opinfo.op = op
    return opinfo


def test_run_case_fails_on_a_wrong_tpu_result():
    def off_by_one_on_tpu(x, *args, **kwargs):
        y = torch.abs(x, *args, **kwargs)
        return y + 1 if y.device.type == harness.DEVICE_TYPE else y

    with pytest.raises(harness.Mismatch, match="abs"):
        harness.run_case(_broken("abs", off_by_one_on_tpu), harness.FLOAT32, "strict", harness.Selection(1))


def test_run_case_fails_on_a_wrong_gradient():
    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 2 if grad.device.type == harness.DEVICE_TYPE else grad

    with pytest.raises(harness.Mismatch, match="gradients"):
        harness.run_case(_broken("abs", lambda x: Doubled.apply(x)), harness.GRAD, "strict", harness.Selection(1))


def test_run_case_requires_tpu_to_reject_what_cpu_rejects():
    def rejects_only_on_cpu(x, *args, **kwargs):
        if x.device.type == "cpu":
            raise RuntimeError("bad input")
        return torch.abs(x)

    with pytest.raises(harness.Mismatch, match="tpu did not raise"):
        harness.run_case(_broken("abs", rejects_only_on_cpu), harness.FLOAT32, "strict", harness.Selection(1))


def test_tolerance_follows_the_compared_values_dtype():
    """An int64 sample of `tan` yields float32 values: compared with float32's tolerance, while
    integer results stay exact."""
    assert harness.tolerance(torch.int64, (0.1, 0.1)) == (0.0, 0.0)
    assert harness.tolerance(torch.float32, (0.0, 0.0)) == harness.BASE_TOLERANCE[torch.float32]
    assert harness.tolerance(torch.float32, (1e-2, 0.0)) == (1e-2, harness.BASE_TOLERANCE[torch.float32][1])
    assert harness.tolerance(torch.complex64, (0.0, 0.0)) == harness.BASE_TOLERANCE[torch.float32]
    ints = torch.tensor([1, 2])
    with pytest.raises(harness.Mismatch, match="not equal"):
        harness.compare(ints.to(harness.DEVICE) + 1, ints, **TOL)
    floats = torch.tensor([1.0, 2.0])
    harness.compare(torch.nextafter(floats, floats + 1).to(harness.DEVICE), floats, **TOL)


def test_samples_reach_tpu_with_their_layout():
    base = torch.arange(20.0)
    view = base[5:15].as_strided((2, 3), (1, 2), 6)
    sample = harness.SampleInput(view, args=(base[::4], torch.float32, "cpu"))
    moved = harness.to_device(sample)
    for original, copied in zip((view, base[::4]), (moved.input, moved.args[0])):
        assert copied.device == harness.DEVICE
        assert (copied.shape, copied.stride(), copied.storage_offset()) == (
            original.shape, original.stride(), original.storage_offset())
        assert torch.equal(copied.cpu(), original)
    # `as_strided` with an explicit offset addresses the storage, as on CPU.
    assert torch.equal(moved.input.as_strided((2,), (3,), 0).cpu(), view.as_strided((2,), (3,), 0))
    assert moved.args[1:] == (torch.float32, str(harness.DEVICE))


def test_a_factory_sample_without_a_device_runs_on_tpu():
    opinfo = harness.entries()["arange"]
    result = harness.run_case(opinfo, harness.FLOAT32, "strict", harness.Selection(None, None))
    assert result.checked > 20
    with harness._default_device(harness.SampleInput(2)):
        assert torch.arange(2).device == harness.DEVICE
    with harness._default_device(harness.SampleInput(2, kwargs={"device": "cpu"})):
        assert torch.arange(2).device.type == "cpu"
