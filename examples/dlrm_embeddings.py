"""TorchRec's DLRM with its embedding tables fused and sharded on SparseCores, trained on `tpu`.

The TorchRec model is unchanged: its `EmbeddingBagCollection` is a
`SparseCoreEmbeddingBagCollection` (tables MOD-sharded over every SparseCore of every tpu device,
Adagrad applied inside the backward), and a prefetching loader preprocesses the next batches'
sparse features on a background thread while the current one trains.

    python -m examples.dlrm_embeddings [--steps N] [--batch B] [--mode strict|defer|compiled]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torchrec.datasets.random import RandomRecDataset
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig

import torchtpu
from embeddings import PrefetchingLoader, SparseCoreEmbeddingBagCollection
from sparsecore.optimizers import Adagrad

KEYS = ["cat_0", "cat_1", "cat_2", "cat_3"]
ROWS = [1000, 500, 2000, 100]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="samples per batch (a multiple of the SparseCores)")
    parser.add_argument("--mode", choices=["strict", "defer", "compiled"], default="strict")
    args = parser.parse_args()

    tables = [EmbeddingBagConfig(name=f"t_{key}", num_embeddings=rows, embedding_dim=16, feature_names=[key])
              for key, rows in zip(KEYS, ROWS)]
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=args.batch, optimizer=Adagrad(learning_rate=0.05))
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[64, 16],
                 over_arch_layer_sizes=[64, 1], dense_device=torch.device("tpu")).to("tpu")
    dense = [p for name, p in model.named_parameters() if not name.startswith("sparse_arch.")]
    optimizer = torch.optim.Adagrad(dense, lr=0.05)
    forward = torch.compile(model, backend="tpu") if args.mode == "compiled" else model
    torchtpu.set_eager_mode("strict" if args.mode == "compiled" else args.mode)

    data = RandomRecDataset(keys=KEYS, batch_size=args.batch, hash_sizes=ROWS, ids_per_features=[2, 1, 3, 1],
                            num_dense=13, num_batches=args.steps)

    def prepare(batch):
        return batch.dense_features.to("tpu"), ebc.prepare(batch.sparse_features), batch.labels.float().to("tpu")

    losses = []
    start = time.perf_counter()
    with PrefetchingLoader(data, prepare, depth=2) as loader:
        for step, (dense_features, sparse_features, labels) in enumerate(loader, 1):
            logits = forward(dense_features, sparse_features).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if step == 1 or step % 20 == 0:
                print(f"step {step:4d}  loss {np.mean(losses[-20:]):.4f}")
    elapsed = time.perf_counter() - start
    print(f"{args.steps} steps in {elapsed:.1f} s ({args.mode} mode); waited {loader.waited_seconds:.2f} s for "
          f"batches; stacks {ebc.stacks}")


if __name__ == "__main__":
    main()
