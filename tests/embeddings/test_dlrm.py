"""A DLRM built from torchrec.models.dlrm.DLRM with a SparseCoreEmbeddingBagCollection trains on
`tpu`, fed by the prefetching loader: the loss falls."""

from __future__ import annotations

import numpy as np
import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings import PrefetchingLoader, SparseCoreEmbeddingBagCollection
from sparsecore.optimizers import Adagrad

BATCH = 32
STEPS = 24


def _batches(rng: np.random.Generator, count: int) -> list[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    """Clicks that depend on the sparse ids (and a little on the dense features)."""
    batches = []
    for _ in range(count):
        ids = rng.integers(0, 100, size=(3, BATCH))
        dense = rng.standard_normal((BATCH, 4)).astype(np.float32)
        label = ((ids[0] % 2 == 0) ^ (ids[1] < 50) ^ (dense[:, 0] > 1.5)).astype(np.float32)
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.from_numpy(ids.reshape(-1)),
                                lengths=torch.ones(3 * BATCH, dtype=torch.int64))
        batches.append((torch.from_numpy(dense), kjt, torch.from_numpy(label)))
    return batches


def test_dlrm_loss_falls():
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=100, embedding_dim=8, feature_names=[f"f{i}"]) for i in range(3)
    ]
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=Adagrad(learning_rate=0.1))
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[16, 1], dense_device=torch.device("tpu")).to("tpu")
    assert ebc.stacked_state.hyper_learning_rate.device.type == "cpu"  # state stays where the ops read it
    dense_parameters = [p for name, p in model.named_parameters() if "embedding_bag_collection" not in name]
    dense_optimizer = torch.optim.Adagrad(dense_parameters, lr=0.1)
    data = _batches(np.random.default_rng(0), 4) * (STEPS // 4)

    def prepare(batch):
        dense, kjt, label = batch
        return dense.to("tpu"), ebc.prepare(kjt), label.to("tpu")

    losses = []
    with PrefetchingLoader(data, prepare, depth=2) as loader:
        for dense, sparse, label in loader:
            logits = model(dense, sparse).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
            dense_optimizer.zero_grad()
            loss.backward()
            dense_optimizer.step()
            losses.append(float(loss.detach()))
    assert len(losses) == STEPS and all(np.isfinite(losses))
    first, last = np.mean(losses[:4]), np.mean(losses[-4:])
    assert last < 0.6 * first, losses
