"""Inputs and references for the embedding tests: random KJTs, and training that no one here wrote.

- `FbgemmTraining`: FBGEMM's CPU table-batched embedding (what TorchRec's fused kernel runs) with
  its exact fused optimizers (SGD, Adagrad, row-wise Adagrad), applied in its backward.
- `SparseAdamTraining`: `nn.EmbeddingBag(sparse=True)` per table and `torch.optim.SparseAdam`.
- `TorchRecSequenceTraining`: TorchRec's unsharded `EmbeddingCollection` with
  `apply_optimizer_in_backward` (torch's SGD / Adagrad, TorchRec's RowWiseAdagrad).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import optimizers as opt

LEARNING_RATE = 0.05
EPSILON = 1e-6
OPTIMIZERS = {
    "sgd": opt.SGD(learning_rate=LEARNING_RATE),
    "adagrad": opt.Adagrad(learning_rate=LEARNING_RATE, epsilon=EPSILON),
    "rowwise_adagrad": opt.RowWiseAdagrad(learning_rate=LEARNING_RATE, epsilon=EPSILON),
    "adam": opt.Adam(learning_rate=LEARNING_RATE, epsilon=EPSILON),
}


def bag_tables(pooling: PoolingType = PoolingType.SUM) -> list[EmbeddingBagConfig]:
    """4 tables of 64-512 rows, dims 8 and 16."""
    sizes, dims = (64, 200, 512, 96), (8, 16, 8, 16)
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=v, embedding_dim=d, feature_names=[f"f{i}"], pooling=pooling)
        for i, (v, d) in enumerate(zip(sizes, dims))
    ]


def sequence_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name=f"s{i}", num_embeddings=v, embedding_dim=8, feature_names=[f"q{i}"])
        for i, v in enumerate((128, 64, 300))
    ]


def random_kjt(
    rng: np.random.Generator,
    keys_and_sizes: Sequence[tuple[str, int]],
    batch_size: int,
    max_length: int = 4,
    weighted: bool = False,
) -> KeyedJaggedTensor:
    """Ids in [0, size) for each key, 0..max_length per sample, some repeated within a sample."""
    lengths = rng.integers(0, max_length + 1, size=(len(keys_and_sizes), batch_size))
    values = [rng.integers(0, size, size=int(lengths[i].sum())) for i, (_, size) in enumerate(keys_and_sizes)]
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, int(lengths.sum())).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor(
        keys=[key for key, _ in keys_and_sizes],
        values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
        lengths=torch.from_numpy(lengths.reshape(-1).astype(np.int64)),
        weights=weights,
    )


def kjt_keys(tables: Sequence[EmbeddingBagConfig | EmbeddingConfig]) -> list[tuple[str, int]]:
    return [(feature, t.num_embeddings) for t in tables for feature in t.feature_names]


_FBGEMM = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
           "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}


class FbgemmTraining:
    """FBGEMM's CPU TBE over `tables` (one feature each), weights copied from `weights`."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], weights: dict[str, torch.Tensor], optimizer: str) -> None:
        pooling = PoolingMode.MEAN if tables[0].pooling == PoolingType.MEAN else PoolingMode.SUM
        self.names = [t.name for t in tables]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables
            ],
            optimizer=_FBGEMM[optimizer],
            learning_rate=LEARNING_RATE,
            eps=EPSILON,
            pooling_mode=pooling,
        )
        with torch.no_grad():
            for table, name in zip(self.tbe.split_embedding_weights(), self.names):
                table.copy_(weights[name])

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.tbe(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights_or_none())

    def step(self, kjt: KeyedJaggedTensor, output_grad: torch.Tensor) -> None:
        (self.forward(kjt) * output_grad).sum().backward()

    def tables(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in zip(self.names, self.tbe.split_embedding_weights())}


class SparseAdamTraining:
    """`nn.EmbeddingBag(sparse=True)` per table (sum pooling) and `torch.optim.SparseAdam`."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], weights: dict[str, torch.Tensor], adam: opt.Adam) -> None:
        self.bags = {
            t.name: torch.nn.EmbeddingBag.from_pretrained(
                weights[t.name].clone(), freeze=False, mode="sum", sparse=True, include_last_offset=True
            )
            for t in tables
        }
        params = [bag.weight for bag in self.bags.values()]
        betas = (adam.beta1, adam.beta2)
        self.optimizer = torch.optim.SparseAdam(params, lr=adam.learning_rate, betas=betas, eps=adam.epsilon)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        parts = kjt.to_dict()
        pooled = [bag(parts[f"f{i}"].values(), parts[f"f{i}"].offsets()) for i, bag in enumerate(self.bags.values())]
        return torch.cat(pooled, dim=1)

    def step(self, kjt: KeyedJaggedTensor, output_grad: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        (self.forward(kjt) * output_grad).sum().backward()
        self.optimizer.step()

    def tables(self) -> dict[str, torch.Tensor]:
        return {name: bag.weight.detach().clone() for name, bag in self.bags.items()}


class TorchRecSequenceTraining:
    """TorchRec's unsharded `EmbeddingCollection` with the optimizer applied in its backward."""

    def __init__(self, tables: Sequence[EmbeddingConfig], weights: dict[str, torch.Tensor], optimizer: str) -> None:
        self.ec = EmbeddingCollection(tables=list(tables), need_indices=True)
        self.ec.load_state_dict({f"embeddings.{name}.weight": value for name, value in weights.items()})
        if optimizer == "adam":
            self._adam = torch.optim.SparseAdam(
                [self._sparse(name) for name in weights], lr=LEARNING_RATE, betas=(0.9, 0.999), eps=EPSILON
            )
            return
        self._adam = None
        optimizer_class, kwargs = {
            "sgd": (torch.optim.SGD, {"lr": LEARNING_RATE}),
            "adagrad": (torch.optim.Adagrad, {"lr": LEARNING_RATE, "eps": EPSILON}),
            "rowwise_adagrad": (TorchRecRowWiseAdagrad, {"lr": LEARNING_RATE, "eps": EPSILON}),
        }[optimizer]
        apply_optimizer_in_backward(optimizer_class, self.ec.parameters(), kwargs)

    def _sparse(self, name: str) -> torch.nn.Parameter:
        self.ec.embeddings[name].sparse = True
        return self.ec.embeddings[name].weight

    def forward(self, kjt: KeyedJaggedTensor) -> dict:
        return self.ec(kjt)

    def step(self, kjt: KeyedJaggedTensor, output_grads: dict[str, torch.Tensor]) -> None:
        if self._adam is not None:
            self._adam.zero_grad()
        out = self.forward(kjt)
        sum((out[name].values() * grad).sum() for name, grad in output_grads.items()).backward()
        if self._adam is not None:
            self._adam.step()

    def tables(self) -> dict[str, torch.Tensor]:
        return {name: module.weight.detach().clone() for name, module in self.ec.embeddings.items()}


def local_samples(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples [start, stop) of every key: what one process of several feeds."""
    values, lengths, weights = [], [], []
    for jagged in kjt.to_dict().values():
        offsets = jagged.offsets()
        values.append(jagged.values()[offsets[start] : offsets[stop]])
        lengths.append(jagged.lengths()[start:stop])
        if jagged.weights_or_none() is not None:
            weights.append(jagged.weights()[offsets[start] : offsets[stop]])
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weights else None,
    )


def bag_reference(optimizer: str, tables: Sequence[EmbeddingBagConfig], weights: dict[str, torch.Tensor]):
    """The fused reference of `optimizer`: FBGEMM's, or SparseAdam for Adam."""
    if optimizer == "adam":
        return SparseAdamTraining(tables, weights, OPTIMIZERS["adam"])
    return FbgemmTraining(tables, weights, optimizer)


def check_bag_training(
    module, run, tables, optimizer: str, steps: int, batch_size: int, rows: slice, seed: int
) -> FbgemmTraining | SparseAdamTraining:
    """Train `run` (the module, or it compiled) on its `rows` of each global batch and the fused
    reference on the whole batch, from the same weights: outputs equal at every step and tables
    equal at the end, within 1e-5; every table moved and none got a `.grad`. Returns the trained
    reference."""
    initial = {key.split(".")[1]: value for key, value in module.state_dict().items()}
    reference = bag_reference(optimizer, tables, initial)
    rng = np.random.default_rng(seed)
    width = sum(t.embedding_dim for t in tables)
    for _ in range(steps):
        kjt = random_kjt(rng, kjt_keys(tables), batch_size)
        grad = torch.from_numpy(rng.standard_normal((batch_size, width)).astype(np.float32))
        out = run(local_samples(kjt, rows.start, rows.stop)).values()
        expected = reference.forward(kjt).detach()[rows]
        torch.testing.assert_close(out.detach().cpu(), expected, rtol=0, atol=1e-5)
        (out * grad[rows].to("tpu")).sum().backward()
        reference.step(kjt, grad)
    trained = {key.split(".")[1]: value for key, value in module.state_dict().items()}
    for name, expected in reference.tables().items():
        torch.testing.assert_close(trained[name], expected, rtol=0, atol=1e-5, msg=name)
        assert not torch.equal(trained[name], initial[name]), name
    assert all(param.grad is None for param in module.parameters())
    return reference
