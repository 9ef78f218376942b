"""Sparse layouts on tpu: the device has dense layouts only, so every op that reaches a sparse
tpu tensor -- making one included -- raises an error that says what to use instead, rather than
PyTorch's "could not run ... with arguments from the 'Sparsetpu' backend"."""

from __future__ import annotations

import pytest
import torch

import torchtpu  # noqa: F401  (registers the tpu device)
from torchtpu.exec.kernels import SparseLayoutError

INDICES = torch.tensor([[0, 2], [1, 4]])


def test_an_embedding_with_sparse_gradients_is_refused_naming_the_alternatives():
    embedding = torch.nn.Embedding(5, 3, sparse=True).to("tpu")
    loss = embedding(INDICES.to("tpu")).sum()
    with pytest.raises(SparseLayoutError, match="sparse tensors are not supported on tpu") as raised:
        loss.backward()
    assert "sparse=False" in str(raised.value) and "SparseCoreEmbeddingBagCollection" in str(raised.value)


def test_the_dense_embedding_still_trains_as_on_the_cpu():
    cpu = torch.nn.Embedding(5, 3)
    tpu = torch.nn.Embedding(5, 3).to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    cpu(INDICES).pow(2).sum().backward()
    tpu(INDICES.to("tpu")).pow(2).sum().backward()
    torch.testing.assert_close(tpu.weight.grad.cpu(), cpu.weight.grad)


def test_making_a_sparse_tpu_tensor_is_refused():
    values = torch.tensor([1.0, 2.0])
    with pytest.raises(SparseLayoutError, match="sparse tensors are not supported on tpu"):
        torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (3,), device="tpu")
    with pytest.raises(SparseLayoutError, match="sparse tensors are not supported on tpu"):
        torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (3,)).to("tpu")


def test_ops_on_a_compressed_tpu_tensor_are_refused():
    """PyTorch builds a CSR tensor without dispatching an op; the first op on it is refused."""
    csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([1.0, 2.0]), (2, 2),
                                  device="tpu")
    with pytest.raises(SparseLayoutError, match="sparse tensors are not supported on tpu"):
        csr.to_dense()
