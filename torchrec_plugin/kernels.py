"""The lookup inside one shard of a DMP-sharded embedding module on `tpu`.

TorchRec groups a shard's local tables into `GroupedEmbeddingConfig`s and builds one kernel per
group (FBGEMM's TBE on GPU). Here a FUSED group becomes a `SparseCoreEmbeddingBag`: an
`embeddings.SparseCoreEmbeddingBagCollection` over the local shards of its tables (MOD-sharded
over the SparseCores of this process's device, optimizer applied in the backward), and a DENSE
group (data-parallel tables) a `DenseEmbeddingBag` whose gradients DDP all-reduces.

TorchRec's state machinery (ShardedTensors in `state_dict`, `load_state_dict`, DCP) works on
plain tensors in TorchRec's layout, while SparseCore tables are stacked and MOD-sharded. So each
SparseCore kernel keeps a *mirror*: one tensor per local shard in TorchRec's layout on the same
device. `flush()` (TorchRec calls it before every `state_dict`) copies the tables into the
mirror; `push()` (after a load or an initialisation) copies the mirror into the tables. The
mirror costs one more copy of the shard's weights in HBM; the planner's storage estimate counts it.
The optimizer slots have no mirror: the kernel's `fused_optimizer` (`torchrec_plugin.fused_optimizer`)
copies them to the host in TorchRec's layout when its state is read, and back after a load.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_kernel import BaseEmbedding, get_state_dict
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings import (
    SparseCoreEmbeddingBagCollection,
    SparseCoreEmbeddingCollection,
    SparseCoreEmbeddingConfig,
    runtime_topology,
)
from sparsecore import optimizers
from torchrec_plugin.fused_optimizer import LocalTable, ShardOptimizer

__all__ = [
    "DEFAULT_LIMIT_GROWTH", "LIMITS", "LIMIT_GROWTH", "DenseEmbeddingBag", "SparseCoreEmbeddingBag",
    "SparseCoreKernel", "check_limits", "fused_settings", "sparsecore_optimizer",
]

LIMITS = "sparsecore_limits"
"""The `fused_params` key of the limits every FUSED table starts from:
`(max_ids_per_partition, max_unique_ids_per_partition)` (unset: `sparsecore`'s defaults)."""

LIMIT_GROWTH = "sparsecore_limit_growth"
"""The `fused_params` key of how a kernel's SparseCore limits grow: a margin >= 1, or None."""

DEFAULT_LIMIT_GROWTH = 1.5
"""A FUSED group's collection starts from the default limits of its tables and, on one host,
grows them to 1.5x what a batch over them needs (one new layout and compile, logged and
counted), so DMP runs whatever the batch size and id distribution. With None, or on several
hosts (whose limits must agree), a batch over the limits raises, naming stack, limit, observed
and configured values."""

_IGNORED_FUSED_PARAMS = frozenset(
    {"output_dtype", "stochastic_rounding", "bounds_check_mode", "enforce_hbm", "prefetch_pipeline",
     "cache_precision", "weights_precision"}
)
"""FBGEMM options with no effect on fp32 SparseCore tables held whole in HBM."""


def sparsecore_optimizer(fused_params: dict[str, Any] | None) -> optimizers.OptimizerSpec:
    """The `sparsecore` optimizer for TorchRec's fused parameters (`fused_params` of a sharder or
    `apply_optimizer_in_backward`; FBGEMM's defaults: exact SGD at learning rate 0.01)."""
    params = dict(fused_params or {})
    kind = params.pop("optimizer", EmbOptimType.EXACT_SGD)
    rate = float(params.pop("learning_rate", 0.01))
    eps = float(params.pop("eps", 1e-8))
    weight_decay = float(params.pop("weight_decay", 0.0))
    beta1, beta2 = float(params.pop("beta1", 0.9)), float(params.pop("beta2", 0.999))
    unknown = sorted(set(params) - _IGNORED_FUSED_PARAMS)
    if unknown:
        raise ValueError(f"fused_params {unknown} are not supported by the SparseCore kernels")
    if weight_decay:
        raise ValueError(f"fused optimizer weight_decay={weight_decay} is not supported on SparseCore")
    if kind in (EmbOptimType.EXACT_SGD, EmbOptimType.SGD):
        return optimizers.SGD(learning_rate=rate)
    if kind == EmbOptimType.EXACT_ADAGRAD:
        return optimizers.Adagrad(learning_rate=rate, epsilon=eps)
    if kind == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return optimizers.RowWiseAdagrad(learning_rate=rate, epsilon=eps)
    if kind == EmbOptimType.ADAM:
        return optimizers.Adam(learning_rate=rate, beta1=beta1, beta2=beta2, epsilon=eps)
    raise ValueError(f"fused optimizer {kind} has no SparseCore implementation (SGD, Adagrad, row-wise Adagrad, Adam)")


def check_limits(limits: Any) -> tuple[int, int] | None:
    """`limits` as the `LIMITS` setting takes them: None, or two positive ints."""
    if limits is None:
        return None
    if (not isinstance(limits, (tuple, list)) or len(limits) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in limits)):
        raise ValueError(f"SparseCore limits are (max_ids_per_partition, max_unique_ids_per_partition), two "
                         f"positive ints, got {limits!r}")
    return tuple(limits)


def fused_settings(fused_params: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, int]]:
    """What a FUSED group's `fused_params` give: the `embeddings` collection's arguments (its
    optimizer and `limit_growth`: `LIMIT_GROWTH`, `DEFAULT_LIMIT_GROWTH` when unset, None on
    several hosts) and each table's starting limits (`LIMITS`), as `SparseCoreEmbeddingConfig`
    arguments."""
    params = dict(fused_params or {})
    growth = params.pop(LIMIT_GROWTH, DEFAULT_LIMIT_GROWTH)
    if runtime_topology().num_hosts > 1:
        growth = None
    limits = check_limits(params.pop(LIMITS, None))
    table = {} if limits is None else dict(zip(("max_ids_per_partition", "max_unique_ids_per_partition"), limits))
    return {"optimizer": sparsecore_optimizer(params), "limit_growth": growth}, table


class _ShardTables(nn.Module):
    """What both kernels share: the group's local shards as one flat tensor in TorchRec's layout
    (tables one after another, `[local_rows, local_cols]` each), and TorchRec's per-table views."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None, device: torch.device | None,
                 requires_grad: bool) -> None:
        super().__init__()
        self._config = config
        self._pg = pg
        self._shapes = [(t.local_rows, t.local_cols) for t in config.embedding_tables]
        total = sum(rows * cols for rows, cols in self._shapes)
        self._flat = nn.Parameter(torch.empty(total, device=device), requires_grad=requires_grad)
        self._bounds = []
        start = 0
        for rows, cols in self._shapes:
            self._bounds.append((start, start + rows * cols))
            start += rows * cols

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    def shard_weights(self) -> list[torch.Tensor]:
        """Each local shard `[local_rows, local_cols]`, a view of the flat tensor."""
        return [self._flat[a:b].view(shape) for (a, b), shape in zip(self._bounds, self._shapes)]

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()
        return get_state_dict(self._config.embedding_tables, self.shard_weights(), self._pg, destination, prefix)

    def table_runs(self) -> Iterator[tuple[int, int]]:
        """`[i, j)` of each table's local shards: a table's shards (column-wise) are consecutive."""
        tables = self._config.embedding_tables
        i = 0
        while i < len(tables):
            j = i + 1
            while j < len(tables) and tables[j].name == tables[i].name:
                j += 1
            yield i, j
            i = j

    def named_parameters_by_table(self) -> Iterator[tuple[str, TableBatchedEmbeddingSlice]]:
        """One slice per table: a table's consecutive local shards (column-wise) form one slice."""
        tables = self._config.embedding_tables
        for i, j in self.table_runs():
            start, stop = self._bounds[i][0], self._bounds[j - 1][1]
            yield tables[i].name, self._slice(start, stop, tables[i].local_cols)

    def _slice(self, start: int, stop: int, cols: int) -> TableBatchedEmbeddingSlice:
        return TableBatchedEmbeddingSlice(self._flat, start, stop, (stop - start) // cols, cols)

    def flush(self) -> None:
        """Nothing held elsewhere (overridden where the tables live elsewhere)."""

    def purge(self) -> None:
        """No cache to reset."""


class SparseCoreKernel(_ShardTables, BaseEmbedding, FusedOptimizerModule):
    """What the pooled and the unpooled SparseCore kernels share: an `embeddings` collection over
    the group's local shards (one collection table per shard, its features renamed `<feature>#<i>`
    so that shards of one table stay apart), the TorchRec-layout mirror kept in step with it
    (`flush`, `push`), and the fused optimizer TorchRec sees (`torchrec_plugin.fused_optimizer`)."""

    _STATE_PREFIX = ""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                 device: torch.device | None) -> None:
        super().__init__(config, pg, device, requires_grad=False)
        self._keys: list[str] = []
        self._shard_keys: list[list[str]] = []
        for table in config.embedding_tables:
            keys = [f"{feature}#{len(self._keys) + k}" for k, feature in enumerate(table.feature_names)]
            self._keys.extend(keys)
            self._shard_keys.append(keys)

    def _attach(self, collection: SparseCoreEmbeddingBagCollection | SparseCoreEmbeddingCollection,
                shard_names: list[str], pg: dist.ProcessGroup | None) -> None:
        """Adopt `collection`, whose table `shard_names[k]` holds local shard k."""
        tables = self._config.embedding_tables
        self._table_keys = [f"{self._STATE_PREFIX}{name}.weight" for name in shard_names]
        # Held outside the module tree: TorchRec collects (and re-keys) the fused optimizer of
        # every FusedOptimizerModule below a lookup, and the kernel's own presents the tables.
        self.__dict__["_collection"] = collection
        weights = dict(super().named_parameters_by_table())
        self._optimizer = ShardOptimizer(collection, [
            LocalTable(tables[i].name, weights[tables[i].name], tuple(
                (tables[k], shard_names[k]) for k in range(i, j)
            ))
            for i, j in self.table_runs()
        ], pg)

    def _renamed(self, features: KeyedJaggedTensor, weighted: bool) -> KeyedJaggedTensor:
        """`features` under the collection's feature names, its batch size set on the collection."""
        if features.variable_stride_per_key():
            raise ValueError("SparseCore lookups need one batch size for every feature (no variable batch)")
        stride = features.stride()
        self._collection.set_batch_size(stride)
        return KeyedJaggedTensor(
            keys=self._keys,
            values=features.values(),
            lengths=features.lengths(),
            weights=features.weights_or_none() if weighted else None,
            stride=stride,
        )

    @property
    def fused_optimizer(self) -> ShardOptimizer:
        return self._optimizer

    def named_parameters_by_table(self) -> Iterator[tuple[str, TableBatchedEmbeddingSlice]]:
        """The tables' slices, marked as trained by the fused optimizer (TorchRec's convention,
        so that dense optimizers leave them alone)."""
        for name, weight in super().named_parameters_by_table():
            weight._in_backward_optimizers = [self._optimizer]
            yield name, weight

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The mirror's tables, marked as trained by the fused optimizer (TorchRec's convention)."""
        for name, weight in self.named_parameters_by_table():
            yield f"{prefix}{'.' if prefix else ''}{name}.weight", weight

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()

    def flush(self) -> None:
        """Tables -> mirror (every process of the mesh must call together)."""
        tables = self._collection.state_dict()
        with torch.no_grad():
            for key, weight in zip(self._table_keys, self.shard_weights()):
                weight.copy_(tables[key].to(weight.device))

    def push(self) -> None:
        """Mirror -> tables."""
        values = {key: weight.detach().cpu() for key, weight in zip(self._table_keys, self.shard_weights())}
        self._collection.load_state_dict(values)


class SparseCoreEmbeddingBag(SparseCoreKernel):
    """The pooled lookup of a FUSED group on the SparseCores of this process's device, with the
    fused optimizer of `config.fused_params` applied in the backward (see the module docstring)."""

    _STATE_PREFIX = "embedding_bags."

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                 device: torch.device | None) -> None:
        super().__init__(config, pg, device)
        settings, limits = fused_settings(config.fused_params)
        bag_configs = [
            SparseCoreEmbeddingConfig(
                EmbeddingBagConfig(name=f"{table.name}#{index}", num_embeddings=table.local_rows,
                                   embedding_dim=table.local_cols, feature_names=keys, pooling=table.pooling),
                **limits,
            )
            for index, (table, keys) in enumerate(zip(config.embedding_tables, self._shard_keys))
        ]
        collection = SparseCoreEmbeddingBagCollection(
            bag_configs,
            batch_size=runtime_topology().num_sparsecores,
            is_weighted=config.is_weighted,
            **settings,
        )
        self._attach(collection, [c.name for c in bag_configs], pg)

    @property
    def collection(self) -> SparseCoreEmbeddingBagCollection:
        return self._collection

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self._collection(self._renamed(features, self._config.is_weighted)).values()


_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


class DenseEmbeddingBag(_ShardTables, BaseEmbedding):
    """The pooled lookup of a DENSE group (data-parallel tables): `embedding_bag` per feature on
    `tpu`; the tables get ordinary gradients (DDP all-reduces them, the dense optimizer steps)."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: dist.ProcessGroup | None,
                 device: torch.device | None) -> None:
        super().__init__(config, pg, device, requires_grad=True)
        for table in config.embedding_tables:
            if table.pooling not in _MODES:
                raise ValueError(f"table {table.name!r}: pooling {table.pooling} is not supported")
        nn.init.uniform_(self._flat, -0.01, 0.01)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        weights = self.shard_weights()
        per_sample = features.weights_or_none() if self._config.is_weighted else None
        lengths = features.length_per_key()
        stride = features.stride()
        offsets = features.offsets()
        outputs = []
        key = 0
        start = 0
        for table, weight in zip(self._config.embedding_tables, weights):
            for _ in table.feature_names:
                stop = start + lengths[key]
                bag_offsets = offsets[key * stride: (key + 1) * stride] - start
                ids = features.values()[start:stop]
                outputs.append(nn.functional.embedding_bag(
                    ids, weight, bag_offsets, mode=_MODES[table.pooling],
                    per_sample_weights=None if per_sample is None else per_sample[start:stop],
                ))
                start, key = stop, key + 1
        return torch.cat(outputs, dim=1)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        combined = "/".join(t.name for t in self._config.embedding_tables)
        yield f"{prefix}{'.' if prefix else ''}{combined}.weight", self._flat
