"""The systems the benchmark times, each over the same tables (same initial weights) and batches.

* `tpu`: `SparseCoreEmbeddingBagCollection` on the tpu device, MOD-sharded over every SparseCore;
  a step is host preprocessing (`prepare`: KJT -> packed buffers on the device), the lookup and,
  in training, the backward with the fused update; in strict, defer (DeferAndFuse) or compiled
  (`torch.compile(backend="tpu")`) mode.
* `fbgemm`: FBGEMM's CPU table-batched embedding (`SplitTableBatchedEmbeddingBagsCodegen`), its
  optimizer fused into the backward.
* `embedding_bag`: one `torch.nn.EmbeddingBag` per table and a torch optimizer, with sparse
  gradients where the optimizer takes them (SGD, Adagrad; TorchRec's row-wise Adagrad does not).
* `torchrec`: TorchRec's unsharded `EmbeddingBagCollection` on CPU, the optimizer applied in the
  backward (`apply_optimizer_in_backward`), sparse gradients as for `embedding_bag`.

`step(i)` runs one step on batch i and returns the seconds it spent preprocessing on the host
(tpu only; the baselines take their natural input, built once, outside the step). `pooled(i)`
is the pooled output of batch i (this process's samples), on the host, without training.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Protocol

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import torchtpu
from embeddings.bench.workload import Workload, host_samples
from embeddings.config import SparseCoreEmbeddingConfig
from embeddings.modules import SparseCoreEmbeddingBagCollection
from sparsecore import optimizers
from sparsecore.topology import Topology

__all__ = ["EPSILON", "EmbeddingBagSystem", "FbgemmSystem", "System", "TorchRecSystem", "TpuSystem"]

EPSILON = 1e-8
"""Adagrad's epsilon, the same in every system."""

_SPARSECORE_OPTIMIZERS = {
    "sgd": optimizers.SGD,
    "adagrad": optimizers.Adagrad,
    "rowwise_adagrad": optimizers.RowWiseAdagrad,
}
_FBGEMM_OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


class System(Protocol):
    """One embedding stack under test."""

    name: str

    def pooled(self, index: int) -> torch.Tensor: ...

    def step(self, index: int) -> float: ...


def _torch_optimizer(name: str, learning_rate: float) -> tuple[type[torch.optim.Optimizer], dict, bool]:
    """(optimizer class, its arguments, whether it takes sparse gradients) for the torch baselines."""
    if name == "sgd":
        return torch.optim.SGD, {"lr": learning_rate}, True
    if name == "adagrad":
        return torch.optim.Adagrad, {"lr": learning_rate, "eps": EPSILON}, True
    return TorchRecRowWiseAdagrad, {"lr": learning_rate, "eps": EPSILON}, False


class TpuSystem:
    """The SparseCore collection on tpu, fed this process's samples of every batch."""

    name = "tpu"

    def __init__(self, workload: Workload, tables: list[SparseCoreEmbeddingConfig], topology: Topology,
                 rank: int) -> None:
        config = workload.config
        samples = host_samples(config, rank)
        optimizer = _SPARSECORE_OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate)
        if "epsilon" in optimizer.hyperparameters():
            optimizer = dataclasses.replace(optimizer, epsilon=EPSILON)
        self.module = SparseCoreEmbeddingBagCollection(
            tables,
            batch_size=samples.stop - samples.start,
            optimizer=optimizer,
            stacking=config.stacking,
            topology=topology,
            seed=config.seed,
        )
        self._run = torch.compile(self.module, backend="tpu") if config.eager_mode == "compiled" else self.module
        self._mode = "strict" if config.eager_mode == "compiled" else config.eager_mode
        self._training = config.training
        self._kjts = [batch.kjt(samples) for batch in workload.batches]
        self._grads = [
            torch.from_numpy(batch.output_grad[samples]).to("tpu") for batch in workload.batches if self._training
        ]

    def weights(self) -> dict[str, torch.Tensor]:
        """Every table's initial values on the host, by table name (every process must call)."""
        prefix = "embedding_bags."
        return {key[len(prefix) : -len(".weight")]: value for key, value in self.module.state_dict().items()}

    def pooled(self, index: int) -> torch.Tensor:
        with torchtpu.eager_mode(self._mode), torch.no_grad():
            return self._run(self.module.prepare(self._kjts[index])).values().cpu()

    def step(self, index: int) -> float:
        with torchtpu.eager_mode(self._mode):
            start = time.perf_counter()
            batch = self.module.prepare(self._kjts[index])
            host = time.perf_counter() - start
            if self._training:
                # As a loss would: `values().backward(grad)` itself makes the second step's
                # collectives differ between processes when each drives one device (see the report).
                (self._run(batch).values() * self._grads[index]).sum().backward()
            else:
                with torch.no_grad():
                    self._run(batch)
            torch.tpu.synchronize()
        return host


class _CpuBaseline(abc.ABC):
    """What the CPU baselines share: they run the whole global batch, take their input as built
    once outside the step (so no host preprocessing), and train by back-propagating the batch's
    output gradient (their optimizers are fused or applied in the backward)."""

    name: str

    def __init__(self, workload: Workload) -> None:
        self.everything = slice(0, workload.config.batch_size)
        self._grads = [torch.from_numpy(b.output_grad) for b in workload.batches if workload.config.training]

    @abc.abstractmethod
    def _forward(self, index: int) -> torch.Tensor:
        """The pooled output `[batch, tables * dim]` of batch `index`."""

    def _train(self, index: int) -> None:
        self._forward(index).backward(self._grads[index])

    def pooled(self, index: int) -> torch.Tensor:
        with torch.no_grad():
            return self._forward(index)

    def step(self, index: int) -> float:
        if self._grads:
            self._train(index)
        else:
            self.pooled(index)
        return 0.0


class FbgemmSystem(_CpuBaseline):
    """FBGEMM's CPU TBE with its fused optimizer."""

    name = "fbgemm"

    def __init__(self, workload: Workload, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(workload)
        config = workload.config
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in workload.tables],
            optimizer=_FBGEMM_OPTIMIZERS[config.optimizer],
            learning_rate=config.learning_rate,
            eps=EPSILON,
            pooling_mode=PoolingMode.SUM if config.combiner == "sum" else PoolingMode.MEAN,
        )
        with torch.no_grad():
            for table, values in zip(self.tbe.split_embedding_weights(), (weights[t.name] for t in workload.tables)):
                table.copy_(values)
        self._inputs = [(kjt.values(), kjt.offsets()) for kjt in (b.kjt(self.everything) for b in workload.batches)]

    def _forward(self, index: int) -> torch.Tensor:
        return self.tbe(*self._inputs[index])


class EmbeddingBagSystem(_CpuBaseline):
    """One `torch.nn.EmbeddingBag` per table and a torch optimizer."""

    name = "embedding_bag"

    def __init__(self, workload: Workload, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(workload)
        config = workload.config
        optimizer, arguments, sparse = _torch_optimizer(config.optimizer, config.learning_rate)
        self.bags = [
            torch.nn.EmbeddingBag.from_pretrained(
                weights[t.name].clone(), freeze=False, mode=config.combiner, sparse=sparse, include_last_offset=True
            )
            for t in workload.tables
        ]
        self.optimizer = optimizer([bag.weight for bag in self.bags], **arguments)
        self._inputs = [
            [(jagged.values(), jagged.offsets()) for jagged in batch.kjt(self.everything).to_dict().values()]
            for batch in workload.batches
        ]

    def _forward(self, index: int) -> torch.Tensor:
        return torch.cat([bag(ids, offsets) for bag, (ids, offsets) in zip(self.bags, self._inputs[index])], dim=1)

    def _train(self, index: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        super()._train(index)
        self.optimizer.step()


class TorchRecSystem(_CpuBaseline):
    """TorchRec's unsharded `EmbeddingBagCollection` on CPU, the optimizer applied in backward."""

    name = "torchrec"

    def __init__(self, workload: Workload, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(workload)
        config = workload.config
        self.ebc = EmbeddingBagCollection(tables=list(workload.tables), device=torch.device("cpu"))
        self.ebc.load_state_dict({f"embedding_bags.{name}.weight": value for name, value in weights.items()})
        if config.training:
            optimizer, arguments, sparse = _torch_optimizer(config.optimizer, config.learning_rate)
            for bag in self.ebc.embedding_bags.values():
                bag.sparse = sparse
            apply_optimizer_in_backward(optimizer, self.ebc.parameters(), arguments)
        self._kjts = [batch.kjt(self.everything) for batch in workload.batches]

    def _forward(self, index: int) -> torch.Tensor:
        return self.ebc(self._kjts[index]).values()
