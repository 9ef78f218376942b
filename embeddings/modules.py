"""Fused, sharded SparseCore embedding collections on `tpu`, with TorchRec types in and out.

`SparseCoreEmbeddingBagCollection` (pooled, returns a `KeyedTensor`) and
`SparseCoreEmbeddingCollection` (unpooled, returns `Dict[str, JaggedTensor]`) take a TorchRec
`KeyedJaggedTensor` (or a `SparseCoreBatch` preprocessed ahead of time) and behave like TorchRec's
unsharded modules with FBGEMM's fused optimizer:

* tables are MOD-sharded over every SparseCore of every device of the mesh (`torchtpu.sharding`),
  stacked automatically (`stacking="auto"`), one per stack (`"none"`) or as `StackGroup`s say;
* the optimizer (a `sparsecore.optimizers` spec) is applied inside `loss.backward()`;
  `fused_optimizer` is a TorchRec `FusedOptimizer`, `set_learning_rate` changes the rate without
  recompiling;
* `state_dict()` holds each table unstacked and unsharded, on the host, under TorchRec's names
  (`embedding_bags.<table>.weight` / `embeddings.<table>.weight`); `load_state_dict` takes them.
  Sharded checkpoints are in `embeddings.checkpoint`.

Outputs hold this process's samples: with one process, a tensor sharded over its devices (rows
split by device); with several, this process's rows on its first tpu device.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from embeddings.config import SparseCoreEmbeddingConfig, TableConfig, as_sparsecore_config, embedding_names
from embeddings.distributed import process_rows
from embeddings.input import SparseCoreBatch, SparseCorePreprocessor
from embeddings.lookup import fused_lookup
from embeddings.ops import StackComputation, register_stack
from embeddings.optim import SparseCoreFusedOptimizer
from embeddings.state import StackedState
from sparsecore.api import SparseCoreEmbedding
from sparsecore.layout import StackedTable, StackGroup, auto_stack_groups, stack_tables
from sparsecore.optimizers import SGD, OptimizerSpec
from sparsecore.preprocess import BufferOverflowError, PartitionLimitError, PartitionStats, update_limits
from sparsecore.topology import CHIP_PRESETS, Topology
from torchtpu import counters, runtime, sharding

__all__ = ["SparseCoreEmbeddingBagCollection", "SparseCoreEmbeddingCollection", "runtime_topology"]

Stacking = str | Sequence[StackGroup]

_log = logging.getLogger(__name__)


def runtime_topology(sparsecores_per_device: int = 4) -> Topology:
    """The topology of the tpu mesh: every process's devices, this process's as local. On the CPU
    stand-in each device plays a chip with `sparsecores_per_device` SparseCores; on a TPU the
    chip comes from the device kind (UNTESTED: no TPU here)."""
    rt = runtime.runtime()
    devices = sharding.mesh_devices()
    if rt.on_tpu:
        kind = devices[0].device_kind
        if kind not in _DEVICE_KINDS:
            raise ValueError(f"TPU device kind {kind!r} has no known SparseCore preset; pass a Topology")
        return Topology(CHIP_PRESETS[_DEVICE_KINDS[kind]], len(devices), len(rt.devices))
    return Topology.cpu(len(devices), sparsecores_per_device, local_device_count=len(rt.devices))


_DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
}
"""JAX `device_kind` -> `sparsecore.topology` preset (chips with SparseCores only; v5e has none)."""


class _SparseCoreCollection(nn.Module, FusedOptimizerModule):
    """What both collections share: layout, state, preprocessing, the fused lookup."""

    _PREFIX: ClassVar[str]
    _POOLED: ClassVar[bool]

    def __init__(
        self,
        tables: Sequence[TableConfig],
        batch_size: int,
        optimizer: OptimizerSpec | None = None,
        stacking: Stacking = "auto",
        topology: Topology | None = None,
        is_weighted: bool = False,
        allow_id_dropping: bool = False,
        limit_growth: float | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if device is not None and torch.device(device).type != "tpu":
            raise ValueError(f"SparseCore embedding tables live on the tpu device, not {device}")
        if limit_growth is not None and not limit_growth >= 1.0:
            raise ValueError(f"limit_growth must be a margin >= 1.0 over the observed ids, got {limit_growth}")
        if limit_growth is not None and allow_id_dropping:
            raise ValueError("limit_growth and allow_id_dropping exclude each other: a batch over a limit either "
                             "grows the limits or has ids dropped")
        self._check_kinds(tables)
        configs = [as_sparsecore_config(table) for table in tables]
        self._check_names(configs)
        optimizer = optimizer if optimizer is not None else SGD()
        topology = topology if topology is not None else runtime_topology()
        self._check_topology(topology)
        if limit_growth is not None and topology.num_hosts > 1:
            raise ValueError(
                f"limit_growth needs one host (this mesh spans {topology.num_hosts}): every host must compile the "
                "same limits, so on several hosts set them in SparseCoreEmbeddingConfig (update_limits over "
                "merged stats gives them)"
            )
        self._configs = configs
        self._is_weighted = is_weighted
        self._optimizer = optimizer
        self._topology = topology
        self._allow_id_dropping = allow_id_dropping
        self._limit_growth = limit_growth
        self._limit_growths = 0
        names_by_table = embedding_names(configs)
        self._embedding_names_by_table = names_by_table
        features = self._features(batch_size)
        engine = self._lay_out(batch_size, _stack_groups(stacking, features, topology))
        host_init = {c.name: c.host_initializer for c in configs if c.host_initializer is not None}
        self._state = StackedState(engine, self._computations, optimizer, seed, host_init)
        tables_in_order = [c.name for c in configs]
        self._fused_optimizer = SparseCoreFusedOptimizer(self._state, optimizer, tables_in_order, self._PREFIX)

    def _features(self, batch_size: int) -> list:
        global_batch = batch_size * self._topology.num_hosts
        features = []
        for config, names in zip(self._configs, self._embedding_names_by_table):
            features.extend(config.feature_specs(config.table_spec(self._optimizer), names, global_batch))
        return features

    def _lay_out(self, batch_size: int, groups: Sequence[StackGroup]) -> SparseCoreEmbedding:
        """The stacks, their computations and the preprocessor for `batch_size` samples per process."""
        configs, names_by_table = self._configs, self._embedding_names_by_table
        stacks = stack_tables(self._features(batch_size), self._topology, groups)
        engine = SparseCoreEmbedding(stacks, self._topology, mesh=sharding.mesh())
        self._computations: dict[str, StackComputation] = {s.name: register_stack(engine, s.name) for s in stacks}
        self._preprocessor = SparseCorePreprocessor(
            engine,
            _readers(configs, names_by_table),
            batch_size,
            {name: c.max_seq_len for c, names in zip(configs, names_by_table) if not c.pooled for name in names},
            weighted=self._is_weighted,
            allow_id_dropping=self._allow_id_dropping,
        )
        return engine

    @property
    def batch_size(self) -> int:
        """Samples per batch of this process that the buffers are laid out for."""
        return self._preprocessor.batch_size

    def set_batch_size(self, batch_size: int) -> None:
        """Lay the per-step buffers out for another batch size; tables, slots and optimizer state
        stay where they are (stacks keep their tables, so only the buffers and programs change).
        What a sharded caller uses when its batch size is only known at the first batch."""
        if batch_size != self.batch_size:
            self._relayout(batch_size, {name: c.stack for name, c in self._computations.items()})

    def _relayout(self, batch_size: int, stacks: Mapping[str, StackedTable]) -> None:
        """Lay the buffers out again for `batch_size`, each stack with the limits of `stacks[name]`
        (its tables and their places unchanged)."""
        groups = tuple(
            StackGroup(s.table_names, name=name, rotation=_rotation(s),
                       max_ids_per_partition=s.max_ids_per_partition,
                       max_unique_ids_per_partition=s.max_unique_ids_per_partition,
                       suggested_coo_buffer_size_per_device=s.suggested_coo_buffer_size_per_device)
            for name, s in stacks.items()
        )
        dropped = self._preprocessor.dropped_ids
        engine = self._lay_out(batch_size, groups)
        self._preprocessor.dropped_ids = dropped
        self._state.rebind(engine, self._computations)

    @property
    def limit_growths(self) -> int:
        """How often a batch over a limit grew the limits (only with `limit_growth`)."""
        return self._limit_growths

    def limits(self) -> dict[str, tuple[int, int]]:
        """Each stack's (max_ids_per_partition, max_unique_ids_per_partition) now."""
        return {name: (c.stack.max_ids_per_partition, c.stack.max_unique_ids_per_partition)
                for name, c in self._computations.items()}

    def _preprocess(self, features: KeyedJaggedTensor) -> SparseCoreBatch:
        """`features` preprocessed; with `limit_growth`, a batch over a stack's limits (or its COO
        buffer) first grows them to what it needs x the margin: buffers and programs are laid out
        anew (one compile), tables and optimizer state stay, and nothing is dropped."""
        try:
            return self._preprocessor(features)
        except (PartitionLimitError, BufferOverflowError):
            if self._limit_growth is None:
                raise
        self._grow_limits(self._preprocessor.observe(features))
        return self._preprocessor(features)

    def _grow_limits(self, stats: Mapping[str, PartitionStats]) -> None:
        stacks = {name: _grown(c.stack, stats[name], self._limit_growth) for name, c in self._computations.items()}
        for name, c in self._computations.items():
            if stacks[name] is not c.stack:
                _log.info(
                    "SparseCore stack %s: limits grown to max_ids_per_partition %d, max_unique_ids_per_partition %d "
                    "(were %d, %d; margin %.2f over this batch's needs): its programs compile again",
                    name, stacks[name].max_ids_per_partition, stacks[name].max_unique_ids_per_partition,
                    c.stack.max_ids_per_partition, c.stack.max_unique_ids_per_partition, self._limit_growth,
                )
        self._relayout(self.batch_size, stacks)
        self._limit_growths += 1
        counters.count("sparsecore_limit_growths")

    def _check_kinds(self, tables: Sequence[TableConfig]) -> None:
        kind = EmbeddingBagConfig if self._POOLED else EmbeddingConfig
        wrong = [
            getattr(table, "name", table)
            for table in tables
            if not isinstance(table.config if isinstance(table, SparseCoreEmbeddingConfig) else table, kind)
        ]
        if wrong:
            raise ValueError(f"{type(self).__name__} takes {kind.__name__}s; table(s) {wrong} are not")

    def _check_names(self, configs: list[SparseCoreEmbeddingConfig]) -> None:
        names = [c.name for c in configs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if not configs or repeated:
            raise ValueError(f"{type(self).__name__} needs tables with distinct names, got {names}")

    @staticmethod
    def _check_topology(topology: Topology) -> None:
        devices = len(sharding.mesh_devices())
        local = len(runtime.runtime().devices)
        if (topology.global_device_count, topology.local_device_count) != (devices, local):
            raise ValueError(
                f"the topology has {topology.global_device_count} devices ({topology.local_device_count} in this "
                f"process) but the tpu mesh has {devices} ({local} in this process)"
            )

    # -- TorchRec interface ---------------------------------------------------------------------

    @property
    def fused_optimizer(self) -> SparseCoreFusedOptimizer:
        return self._fused_optimizer

    def set_learning_rate(self, learning_rate: float) -> None:
        """Change the learning rate of the fused update (a runtime input: nothing recompiles)."""
        self._fused_optimizer.param_groups[0]["lr"] = float(learning_rate)
        self._state.set_hyperparameter("learning_rate", learning_rate)

    @property
    def stacked_state(self) -> StackedState:
        """The stacked, sharded tables, slots and hyper-parameters (see `embeddings.state`)."""
        return self._state

    @property
    def stacks(self) -> dict[str, tuple[str, ...]]:
        """The tables of each stack, by stack name."""
        return {name: c.stack.table_names for name, c in self._computations.items()}

    @property
    def dropped_ids(self) -> int:
        """Ids dropped by the partition limits so far (only with `allow_id_dropping`)."""
        return self._preprocessor.dropped_ids

    def prepare(self, features: KeyedJaggedTensor) -> SparseCoreBatch:
        """Preprocess a KJT on the host into this module's buffers on `tpu` (what a prefetching
        loader calls ahead of the training step, on its own thread). It never changes the module:
        with `limit_growth`, a KJT over the limits comes back `SparseCoreBatch.deferred`, and the
        module grows its limits when it runs that batch."""
        try:
            return self._preprocessor(features)
        except (PartitionLimitError, BufferOverflowError):
            if self._limit_growth is None:
                raise
        return SparseCoreBatch.deferred(features)

    # -- lookup ---------------------------------------------------------------------------------

    @torch._dynamo.disable
    def _batch(self, features: KeyedJaggedTensor | SparseCoreBatch) -> SparseCoreBatch:
        """Host preprocessing (a graph break under `torch.compile`)."""
        if isinstance(features, SparseCoreBatch):
            if features.layout is self._state.engine:
                return features
            if features.source is None:
                raise ValueError("this SparseCoreBatch was laid out for another layout of the module (its batch "
                                 "size or limits changed since) and carries no KJT to prepare again")
            features = features.source
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor or a SparseCoreBatch, got {type(features).__name__}")
        return self._preprocess(features)

    def _stack_activations(self, batch: SparseCoreBatch) -> list[tuple[tuple[str, ...], tuple[int, ...], torch.Tensor]]:
        """Per stack: its features' names and dims, and their activations for this process's
        samples side by side, `[samples, sum of dims]`, sample-major.

        A stack's lookup gives each local SparseCore its samples feature after feature, in the
        stack's order (an invariant `sparsecore.layout.StackedTable` checks). Regrouping them by
        sample is one transpose when the features share a sample count and the stack's
        dim (the common case), else one split and a copy per feature. Either way the backward
        passes over the stack's gradient once: slicing each feature out of the stack on its own
        would make autograd add a zero-padded gradient of the whole stack per feature."""
        local_sparsecores = self._state.engine.topology.local_sparsecores
        blocks = []
        for name, computation in self._computations.items():
            stack = computation.stack
            activations = process_rows(fused_lookup(computation, self._state, batch.buffers[name]))
            per_sparsecore = activations.view(local_sparsecores, stack.batch_size_per_sparsecore, stack.embedding_dim)
            names = tuple(p.feature.name for p in stack.features)
            dims = tuple(p.feature.table.embedding_dim for p in stack.features)
            samples = [p.samples_per_sparsecore for p in stack.features]
            if len(set(samples)) == 1 and set(dims) == {stack.embedding_dim}:
                by_sample = per_sparsecore.view(local_sparsecores, len(names), samples[0], stack.embedding_dim)
                block = by_sample.transpose(1, 2).reshape(local_sparsecores * samples[0], sum(dims))
            else:
                pieces = per_sparsecore.split(samples, dim=1)
                block = torch.cat([piece[:, :, :dim].reshape(-1, dim) for piece, dim in zip(pieces, dims)], dim=1)
            blocks.append((names, dims, block))
        return blocks

    def _feature_rows(self, batch: SparseCoreBatch) -> dict[str, torch.Tensor]:
        """Each feature's activations for this process's samples: `[rows, dim]`, sample-major."""
        return _split_by_feature(self._stack_activations(batch))

    # -- state ----------------------------------------------------------------------------------

    def _weight_key(self, table: str) -> str:
        return f"{self._PREFIX}{table}.weight"

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """Each table unstacked and unsharded, on the host (every process must call together)."""
        for config in self._configs:
            where = self._state.table_slot(config.name, None)
            destination[prefix + self._weight_key(config.name)] = torch.from_numpy(self._state.to_host(where))

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        ours = {prefix + self._weight_key(c.name): c.name for c in self._configs}
        loaded = {}
        for key, table in ours.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key].detach()
            where = self._state.table_slot(table, None)
            if tuple(value.shape) != where.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                  f"the table is {where.shape}")
                continue
            loaded[where] = value.to("cpu", torch.float32).numpy()
        self._state.load_host_tables(loaded)
        children = tuple(f"{prefix}{name}." for name in self._modules)
        unexpected_keys.extend(
            key for key in state_dict if key.startswith(prefix) and key not in ours and not key.startswith(children)
        )


def _split_by_feature(blocks: list[tuple[tuple[str, ...], tuple[int, ...], torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each feature's columns of its stack's block (views; one split per stack)."""
    return {name: rows for names, dims, block in blocks for name, rows in zip(names, block.split(dims, dim=1))}


class SparseCoreEmbeddingBagCollection(_SparseCoreCollection):
    """Pooled embeddings of a KJT's features as a TorchRec `KeyedTensor`, like TorchRec's
    `EmbeddingBagCollection`, fused and sharded on SparseCores.

    `tables`: TorchRec `EmbeddingBagConfig`s, or `SparseCoreEmbeddingConfig`s wrapping them with
    limits. `batch_size`: samples per batch of this process (the layout is static). `optimizer`:
    a `sparsecore.optimizers` spec (default `SGD()`). `stacking`: "auto", "none" or `StackGroup`s.
    `topology`: default `runtime_topology()`. `is_weighted`: KJTs carry per-id weights (pooled as
    SparseCore does: mean divides by the weights' sum). `allow_id_dropping`: ids past a partition
    limit are dropped and counted instead of raising. `limit_growth`: a margin >= 1; a batch past
    a stack's limits then grows them to its needs x the margin (a new layout and one compile;
    counted in `limit_growths` and `torchtpu.metrics()`, logged) instead of raising -- one host
    only. `seed`: of the on-device initialisation.
    """

    _PREFIX = "embedding_bags."
    _POOLED = True

    def __init__(self, tables: Sequence[EmbeddingBagConfig | SparseCoreEmbeddingConfig], batch_size: int,
                 **kwargs: Any) -> None:
        super().__init__(tables, batch_size, **kwargs)
        self._names = [name for names in self._embedding_names_by_table for name in names]
        self._dims = [c.config.embedding_dim for c, names in zip(self._configs, self._embedding_names_by_table)
                      for _ in names]

    def forward(self, features: KeyedJaggedTensor | SparseCoreBatch) -> KeyedTensor:
        blocks = self._stack_activations(self._batch(features))
        if [name for names, _, _ in blocks for name in names] == self._names:
            values = blocks[0][2] if len(blocks) == 1 else torch.cat([block for _, _, block in blocks], dim=1)
        else:
            rows = _split_by_feature(blocks)
            values = torch.cat([rows[name] for name in self._names], dim=1)
        return KeyedTensor(keys=self._names, length_per_key=self._dims, values=values)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return [c.config for c in self._configs]

    def is_weighted(self) -> bool:
        return self._is_weighted


class SparseCoreEmbeddingCollection(_SparseCoreCollection):
    """Unpooled embeddings of a KJT's features as `Dict[str, JaggedTensor]`, like TorchRec's
    `EmbeddingCollection`, fused and sharded on SparseCores.

    `tables`: `SparseCoreEmbeddingConfig`s wrapping TorchRec `EmbeddingConfig`s with `max_seq_len`
    (every sample's ids are looked up as a static `[batch, max_seq_len]` block and the real ones
    selected; a longer sample is an error). `need_indices`: each `JaggedTensor` carries the ids as
    its weights (TorchRec's behaviour). Other arguments as `SparseCoreEmbeddingBagCollection`.
    The outputs' sizes follow the data: under `torch.compile` use `dynamic=False` (one graph per
    size), as the tpu backend lowers symbolic sizes at the sizes it traced.
    """

    _PREFIX = "embeddings."
    _POOLED = False

    def __init__(self, tables: Sequence[SparseCoreEmbeddingConfig], batch_size: int, need_indices: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(tables, batch_size, **kwargs)
        self._need_indices = need_indices
        self._outputs = [
            (key, name)
            for config, names in zip(self._configs, self._embedding_names_by_table)
            for key, name in zip(config.feature_names, names)
        ]

    def forward(self, features: KeyedJaggedTensor | SparseCoreBatch) -> dict[str, JaggedTensor]:
        batch = self._batch(features)
        rows = self._feature_rows(batch)
        return {
            name: JaggedTensor(
                values=rows[name].index_select(0, batch.sequence_rows[name]),
                lengths=batch.lengths[key],
                weights=batch.ids[key] if self._need_indices else None,
            )
            for key, name in self._outputs
        }

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return [c.config for c in self._configs]

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._configs[0].config.embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return [list(names) for names in self._embedding_names_by_table]


def _stack_groups(stacking: Stacking, features: list, topology: Topology) -> tuple[StackGroup, ...]:
    if isinstance(stacking, str):
        if stacking == "auto":
            return auto_stack_groups(features, topology)
        if stacking == "none":
            return ()
        raise ValueError(f"stacking must be 'auto', 'none' or a sequence of StackGroup, got {stacking!r}")
    groups = tuple(stacking)
    if not all(isinstance(group, StackGroup) for group in groups):
        raise ValueError(f"stacking groups must be sparsecore StackGroups, got {groups}")
    return groups


def _grown(stack: StackedTable, stats: PartitionStats, margin: float) -> StackedTable:
    """`stack` with limits (and COO buffer, where it has its own size) raised to what `stats`
    needed x `margin` wherever that is more; `stack` itself where nothing needs to grow."""
    needed = update_limits(stack, stats, margin)
    max_ids = max(stack.max_ids_per_partition, needed.max_ids_per_partition)
    max_unique = max(stack.max_unique_ids_per_partition, needed.max_unique_ids_per_partition)
    buffer = stack.suggested_coo_buffer_size_per_device
    if buffer is not None:
        buffer = max(buffer, needed.suggested_coo_buffer_size_per_device)
    if (max_ids, max_unique, buffer) == (stack.max_ids_per_partition, stack.max_unique_ids_per_partition,
                                         stack.suggested_coo_buffer_size_per_device):
        return stack
    return stack.with_limits(max_ids, max_unique, buffer)


def _rotation(stack) -> int:
    """The rotation that placed the stack's tables (the step between consecutive tables'
    `shard_rotation`s; any value for a single table, whose rotation is 0)."""
    if len(stack.tables) < 2:
        return 0
    return (stack.tables[1].shard_rotation - stack.tables[0].shard_rotation) % stack.num_sparsecores


def _readers(
    configs: list[SparseCoreEmbeddingConfig], names_by_table: list[tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """KJT key -> the features (embedding names) that read it."""
    readers: dict[str, list[str]] = {}
    for config, names in zip(configs, names_by_table):
        for key, name in zip(config.feature_names, names):
            readers.setdefault(key, []).append(name)
    return {key: tuple(names) for key, names in readers.items()}
