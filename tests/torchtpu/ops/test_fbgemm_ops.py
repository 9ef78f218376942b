"""FBGEMM's data-distribution ops on `tpu` tensors against FBGEMM's CPU kernels: values, and the
gradient of the pooled-embedding permutations (column-wise sharding's output)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")

from cpu_reference import strict_ops  # noqa: E402,F401  (autouse: a CPU fallback fails the test)
from torchtpu import counters  # noqa: E402
from torchtpu.ops import fbgemm  # noqa: E402

fbgemm.install()
ops = torch.ops.fbgemm


def _tpu(*tensors):
    return [None if t is None else t.to("tpu") for t in tensors]


def _same(got, expected):
    for g, e in zip(got if isinstance(got, (tuple, list)) else [got], expected if isinstance(expected, (tuple, list)) else [expected]):
        assert (g is None) == (e is None)
        if e is not None:
            assert g.device.type == "tpu"
            torch.testing.assert_close(g.cpu(), e, rtol=0, atol=0)


def _permutation_args(dims, permute):
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(dims)]), dtype=torch.int64)
    inverse = list(np.argsort(permute))
    inv_offsets = torch.tensor(np.concatenate([[0], np.cumsum([dims[p] for p in permute])]), dtype=torch.int64)
    return offsets, torch.tensor(permute), inv_offsets, torch.tensor(inverse)


@pytest.mark.parametrize("name", fbgemm.PERMUTE_POOLED)
def test_permute_pooled_embs_values_and_gradient(name):
    dims, permute = [3, 4, 2, 5], [2, 0, 3, 1]
    args = _permutation_args(dims, permute)
    pooled = torch.randn(6, sum(dims), dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    cotangent = torch.randn(6, sum(dims), generator=torch.Generator().manual_seed(1))
    op = getattr(ops, name)
    cpu_in = pooled.clone().requires_grad_("auto_grad" in name)
    expected = op(cpu_in, *args)
    tpu_in = pooled.to("tpu").requires_grad_("auto_grad" in name)
    got = op(tpu_in, *_tpu(*args))
    _same(got.detach(), expected.detach())
    if "auto_grad" in name:
        (expected * cotangent).sum().backward()
        (got * cotangent.to("tpu")).sum().backward()
        torch.testing.assert_close(tpu_in.grad.cpu(), cpu_in.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["asynchronous_complete_cumsum", "asynchronous_exclusive_cumsum",
                                  "asynchronous_inclusive_cumsum"])
def test_cumsums(name):
    lengths = torch.tensor([3, 0, 2, 7, 1], dtype=torch.int64)
    _same(getattr(ops, name)(lengths.to("tpu")), getattr(ops, name)(lengths))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("offsets, range_size", [([0, 2, 2, 5], 7), ([0, 0, 3], 3), ([0], 4), ([0, 4], 4)])
def test_offsets_range(offsets, range_size, dtype):
    offsets = torch.tensor(offsets, dtype=dtype)
    _same(ops.offsets_range(offsets.to("tpu"), range_size), ops.offsets_range(offsets, range_size))


SEGMENTS = [([0, 1, 3], 1), ([0, 0, 2, 2, 4], 3), ([1, 2], 3), ([0], 2), ([2, 2], 1)]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
@pytest.mark.parametrize("csr_seg, batch_size", SEGMENTS)
def test_segment_sum_csr(csr_seg, batch_size, dtype):
    """Empty segments, values before the first segment and after the last (left out, as FBGEMM
    leaves them), no segments at all; integers bit for bit, float32 sums up to their order."""
    values = (torch.randn(4 * batch_size + 2, generator=torch.Generator().manual_seed(3)) * 10).to(dtype)
    for seg_dtype in (torch.int32, torch.int64):
        seg = torch.tensor(csr_seg, dtype=seg_dtype)
        got, expected = ops.segment_sum_csr(batch_size, *_tpu(seg, values)), ops.segment_sum_csr(batch_size, seg, values)
        assert got.device.type == "tpu" and got.dtype == expected.dtype
        exact = dict(rtol=0, atol=0) if not dtype.is_floating_point else {}
        torch.testing.assert_close(got.cpu(), expected, **exact)


def test_segment_sum_csr_past_the_values_is_a_device_side_error():
    from torchtpu.exec.checks import DeviceCheckError

    with pytest.raises(DeviceCheckError, match="segment_sum_csr: the last segment ends past the values"):
        ops.segment_sum_csr(3, *_tpu(torch.tensor([0, 2]), torch.ones(5))).cpu()


def test_variable_batch_length_per_key_on_the_device():
    """TorchRec's `length_per_key` of a variable-batch KJT sums each key's lengths with
    `segment_sum_csr`: the same on tpu as on the CPU, without the CPU fallback."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.tensor([2, 0, 1, 3, 1, 1, 0, 2])
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.arange(10), lengths=lengths,
                            stride_per_key_per_rank=[[2], [4], [2]])
    counters.reset()
    assert kjt.to("tpu").length_per_key() == kjt.length_per_key() == [2, 6, 2]
    assert "cpu_fallback" not in str(counters.snapshot())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("lengths, indices", [([2, 0, 3, 2], [2, 0, 2, 3]), ([1, 1], [1, 1, 0]), ([0, 0], [1]),
                                              ([4, 1], [0])])
def test_jagged_index_select_values_and_gradient(lengths, indices, dtype):
    """`jagged_index_select` (TorchRec's KJT pools): FBGEMM's autograd over the tpu selection and
    its adjoint, without the CPU fallback; equal to FBGEMM's CPU kernels bit for bit, but for the
    gradient of a segment selected twice (its two rows' sum, in another order: float32's
    default tolerance)."""
    lengths, indices = torch.tensor(lengths), torch.tensor(indices)
    values = (torch.randn(int(lengths.sum()), 3, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    results = []
    for device in ("cpu", "tpu"):
        moved = values.to(device, copy=True).requires_grad_(dtype.is_floating_point)
        counters.reset()
        output, output_lengths = ops.jagged_index_select(moved, lengths.to(device), indices.to(device))
        got = [output.detach().cpu(), output_lengths.cpu()]
        if dtype.is_floating_point and output.numel():
            (output * torch.linspace(-1, 2, output.numel(), device=device).reshape(output.shape)).sum().backward()
            got.append(moved.grad.cpu())
        assert "cpu_fallback" not in str(counters.snapshot())
        results.append(got)
    for position, (got, expected) in enumerate(zip(results[1], results[0])):
        torch.testing.assert_close(got, expected, **({} if position == 2 else dict(rtol=0, atol=0)))


def test_position_weighted_features_on_the_device():
    """TorchRec's `PositionWeightedModuleCollection` (what `offsets_range` serves): the same
    weights and parameter gradients as on the CPU, without the CPU fallback."""
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    features = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.arange(8),
                                                   lengths=torch.tensor([2, 0, 1, 3, 1, 1]))
    results = []
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        module = PositionWeightedModuleCollection({"a": 4, "b": 4}).to(device)
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.copy_(torch.linspace(0.5, 2.0, parameter.numel()).reshape(parameter.shape))
        counters.reset()
        weights = module(features.to(device)).weights()
        (weights * torch.arange(8.0, device=device)).sum().backward()
        assert "cpu_fallback" not in str(counters.snapshot())
        results.append([weights.detach().cpu(), *(p.grad.cpu() for p in module.parameters())])
    for got, expected in zip(*reversed(results)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _jagged(rng, features=3, batch=4):
    lengths = torch.from_numpy(rng.integers(0, 4, size=(features, batch)).astype(np.int64))
    values = torch.from_numpy(rng.integers(0, 100, size=int(lengths.sum())).astype(np.int64))
    weights = torch.from_numpy(rng.uniform(size=int(lengths.sum())).astype(np.float32))
    return lengths, values, weights


def test_permute_2D_sparse_data_is_staged_through_the_host():
    lengths, values, weights = _jagged(np.random.default_rng(0))
    permute = torch.tensor([2, 0, 1], dtype=torch.int32)
    counters.reset()
    got = ops.permute_2D_sparse_data(*_tpu(permute, lengths, values, weights))
    _same(got, ops.permute_2D_sparse_data(permute, lengths, values, weights))
    assert "permute_2D_sparse_data" in str(counters.snapshot())


def test_permute_2D_sparse_data_of_1D_lengths_is_staged_through_the_host():
    """The form TorchRec's KJT permute calls under torch.compile (lengths flat, with a stride)."""
    lengths, values, weights = _jagged(np.random.default_rng(2))
    permute = torch.tensor([1, 2, 0], dtype=torch.int32)
    args = (lengths.reshape(-1), values, lengths.shape[1], weights, int(lengths.sum()))
    counters.reset()
    got = ops.permute_2D_sparse_data_input1D(*_tpu(permute, *args[:2]), *args[2:3], weights.to("tpu"), args[4])
    _same(got, ops.permute_2D_sparse_data_input1D(permute, *args))
    assert "permute_2D_sparse_data_input1D" in str(counters.snapshot())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_invert_permute(dtype):
    permute = torch.tensor([3, 0, 4, 1, 2], dtype=dtype)
    _same(ops.invert_permute(permute.to("tpu")), ops.invert_permute(permute))


def test_group_index_select_dim0_values_and_gradient():
    """TorchRec's EmbeddingBagCollection expands deduplicated pooled embeddings with it."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(5, 3, generator=g), torch.randn(4, 2, generator=g)]
    indices = [torch.tensor([4, 0, 0, 2]), torch.tensor([1, 3, 3, 3])]
    cotangents = [torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)]

    def run(device):
        leaves = [x.to(device).requires_grad_() for x in inputs]
        outs = ops.group_index_select_dim0(leaves, [i.to(device) for i in indices])
        sum((out * c.to(device)).sum() for out, c in zip(outs, cotangents)).backward()
        return [out.detach() for out in outs], [x.grad for x in leaves]

    (outs, grads), (expected_outs, expected_grads) = run("tpu"), run("cpu")
    _same(outs, expected_outs)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad.cpu(), expected)
    with pytest.raises(ValueError, match="one index tensor per input"):
        ops.group_index_select_dim0([inputs[0].to("tpu")], [])


REGROUP = dict(keys=[["a", "b"], ["c", "d"]], lengths=[[3, 2], [2, 4]], groups=[["c", "a"], ["b", "a"], ["d"]])


def test_keyed_tensor_regrouping_values_and_gradient():
    """FBGEMM's regrouping of KeyedTensors' columns (TorchRec's `KTRegroupAsDict`), a key in two
    groups included: the plan, the regrouped values and their gradient equal FBGEMM's CPU ones."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 5, generator=g), torch.randn(3, 6, generator=g)]
    plan = ops.kt_regroup_arguments(values[0], **REGROUP)
    tpu_plan = ops.kt_regroup_arguments(values[0].to("tpu"), **REGROUP)
    _same(tpu_plan[:3], plan[:3])
    assert tpu_plan[3] == plan[3]
    cotangents = [torch.randn(3, n, generator=g) for n in plan[3]]

    def run(device, arguments, regroup):
        leaves = [v.clone().to(device).requires_grad_() for v in values]
        outs = regroup(leaves, arguments)
        sum((out * c.to(device)).sum() for out, c in zip(outs, cotangents)).backward()
        return [out.detach() for out in outs], [v.grad for v in leaves]

    permute = lambda leaves, arguments: ops.permute_multi_embedding(leaves, *arguments)  # noqa: E731
    regroup = lambda leaves, _: ops.regroup_keyed_tensor(leaves, **REGROUP)  # noqa: E731
    for fn in (permute, regroup):
        counters.reset()
        (outs, grads), (expected, expected_grads) = run("tpu", tpu_plan, fn), run("cpu", plan, fn)
        _same(outs, expected)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad.cpu(), expected_grad)
        # regroup_keyed_tensor makes its plan on the host: nothing is read back from the device.
        assert ("fbgemm_regroup_plans_read" in counters.snapshot()) == (fn is permute)


def test_kt_regroup_as_dict_on_the_device():
    """TorchRec's module, which keeps its plan on the device: the plan is read to the host once."""
    from torchrec.modules.regroup import KTRegroupAsDict
    from torchrec.sparse.jagged_tensor import KeyedTensor

    g = torch.Generator().manual_seed(1)
    values = [torch.randn(3, 5, generator=g), torch.randn(3, 6, generator=g)]

    def regrouped(device):
        module = KTRegroupAsDict(groups=REGROUP["groups"], keys=["x", "y", "z"])
        tensors = [KeyedTensor(keys, lengths, v.to(device))
                   for keys, lengths, v in zip(REGROUP["keys"], REGROUP["lengths"], values)]
        return [module(tensors) for _ in range(3)]

    counters.reset()
    for got, expected in zip(regrouped("tpu"), regrouped("cpu")):
        assert got.keys() == expected.keys()
        _same([got[k] for k in got], [expected[k] for k in expected])
    assert counters.snapshot()["fbgemm_regroup_plans_read"] == 1


def test_block_bucketize_sparse_features():
    lengths, values, weights = _jagged(np.random.default_rng(1))
    lengths = lengths.reshape(-1)
    block_sizes = torch.tensor([50, 50, 50], dtype=torch.int64)
    args = (lengths, values, False, False, block_sizes, 2, weights)
    expected = ops.block_bucketize_sparse_features(*args)
    got = ops.block_bucketize_sparse_features(*_tpu(lengths, values), False, False, block_sizes.to("tpu"), 2,
                                              weights.to("tpu"))
    _same(got, expected)



JAGGED = [  # trailing shape of the values (FBGEMM takes none or one), segment lengths, padded length
    ((), [2, 0, 4, 1], 3),  # 1-D values; a segment longer than the padded length; an empty one
    ((3,), [2, 0, 4, 1], 5),  # padding past every segment
    ((1,), [1, 3], 2),
    ((3,), [0, 0], 2),  # no values
    ((3,), [], 4),  # no segments
]


def _jagged_values(tail, lengths, dtype, seed=0):
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(int(offsets[-1]), *tail, generator=g) * 4
    return values.to(dtype), offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("tail, lengths, max_length", JAGGED)
def test_jagged_to_padded_dense_and_back_match_fbgemm_cpu(tail, lengths, max_length, dtype):
    values, offsets = _jagged_values(tail, lengths, dtype)
    counters.reset()
    expected = ops.jagged_to_padded_dense(values, [offsets], [max_length], -1.5)
    got = ops.jagged_to_padded_dense(values.to("tpu"), [offsets.to("tpu")], [max_length], -1.5)
    _same(got, expected)
    if dtype.is_floating_point and tail:  # FBGEMM's dense_to_jagged: floating [batch, length, dim] only
        _same(ops.dense_to_jagged(got, [offsets.to("tpu")])[0], ops.dense_to_jagged(expected, [offsets])[0])
    assert "cpu_fallback" not in str(counters.snapshot())


@pytest.mark.parametrize("tail, lengths, max_length", JAGGED)
def test_jagged_padding_gradients_match_fbgemm_cpu(tail, lengths, max_length):
    values, offsets = _jagged_values(tail, lengths, torch.float32)
    cotangent = torch.randn(len(lengths), max_length, *tail, generator=torch.Generator().manual_seed(1))
    grads = []
    for device in ("cpu", "tpu"):
        leaf = values.clone().to(device).requires_grad_()
        padded = ops.jagged_to_padded_dense(leaf, [offsets.to(device)], [max_length], 0.0)
        (padded * cotangent.to(device)).sum().backward()
        grads.append(leaf.grad.cpu())
        if tail:  # FBGEMM's dense_to_jagged: [batch, length, dim] only
            dense = cotangent.clone().to(device).requires_grad_()
            (ops.dense_to_jagged(dense, [offsets.to(device)])[0] * values.to(device)).sum().backward()
            grads.append(dense.grad.cpu())
    half = len(grads) // 2
    for got, expected in zip(grads[half:], grads[:half]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_jagged_tensor_pads_on_the_device():
    """TorchRec's `JaggedTensor.to_padded_dense`, which these kernels serve."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    values, offsets = _jagged_values((), [3, 0, 1], torch.float32)
    lengths = offsets[1:] - offsets[:-1]
    counters.reset()
    got = JaggedTensor(values=values.to("tpu"), lengths=lengths.to("tpu")).to_padded_dense(2, padding_value=7.0)
    _same(got, JaggedTensor(values=values, lengths=lengths).to_padded_dense(2, padding_value=7.0))
    assert "cpu_fallback" not in str(counters.snapshot())

_WITHOUT_THE_PLUGIN = """
import sys
import torch
import torchtpu
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

def regroup(x, y):
    kt1 = KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=x)
    kt2 = KeyedTensor(keys=["c"], length_per_key=[2], values=y)
    out = KeyedTensor.regroup([kt1, kt2], [["b", "c"], ["a"]])
    loss = (out[0] * torch.arange(out[0].shape[1], device=x.device)).sum() + out[1].pow(2).sum()
    loss.backward()
    return out

torch.manual_seed(0)
a, b = torch.randn(4, 5, requires_grad=True), torch.randn(4, 2, requires_grad=True)
ta, tb = a.detach().to("tpu").requires_grad_(), b.detach().to("tpu").requires_grad_()
got, expected = regroup(ta, tb), regroup(a, b)
kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "c"], values=torch.arange(10),
                                          lengths=torch.tensor([2, 0, 1, 3, 2, 2]))
permuted, cpu = kjt.to("tpu").permute([2, 0, 1]), kjt.permute([2, 0, 1])
print("torchrec_plugin" in sys.modules,
      all(torch.equal(g.detach().cpu(), e.detach()) for g, e in zip(got, expected)),
      torch.equal(ta.grad.cpu(), a.grad), torch.equal(tb.grad.cpu(), b.grad),
      torch.equal(permuted.values().cpu(), cpu.values()), torch.equal(permuted.lengths().cpu(), cpu.lengths()))
"""


def test_torchrec_types_on_tpu_take_these_kernels_without_the_plugin(tmp_path):
    """TorchRec imported without `torchrec_plugin` (as `embeddings` users do): the first FBGEMM
    op on a tpu tensor installs the kernels, so `KeyedTensor.regroup` (and its gradient) and
    `KeyedJaggedTensor.permute` match the CPU with the CPU fallback forbidden. Its own
    interpreter: this one installed them at import."""
    env = {**os.environ, "TORCHTPU_STRICT_OPS": "1", "TORCHTPU_LOCK_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _WITHOUT_THE_PLUGIN], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"] + ["True"] * 5
