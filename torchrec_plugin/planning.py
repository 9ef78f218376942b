"""TorchRec's `EmbeddingShardingPlanner` for TPU topologies.

The stock proposers, partitioner and perf model search the plans; the TPU parts are the
estimators (`torchrec_plugin.estimators`), the enumerator's column-wise shard widths
(`torchrec_plugin.enumerator`), a storage reservation for what is not sharded, shard placements
on `tpu:<local rank>`, and a plain answer when a table cannot fit: the planner
names the table, the HBM its cheapest sharding needs on one device, what a device has, and the
difference.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.stats import NoopEmbeddingStats
from torchrec.distributed.planner.storage_reservations import _get_batch_inputs_and_shardable_parameters
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlannerError,
    PlannerErrorType,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import ModuleSharder, ParameterSharding, ShardingPlan

from torchrec_plugin.enumerator import TpuEmbeddingEnumerator
from torchrec_plugin.estimators import TpuPerfEstimator, TpuStorageEstimator
from torchrec_plugin.hardware import TpuTopology

__all__ = [
    "DENSE_BYTES_PER_PARAMETER_BYTE",
    "TpuShardingPlanner",
    "TpuStorageReservation",
    "index_placements",
    "planner",
]

DENSE_BYTES_PER_PARAMETER_BYTE = 4
"""Dense parameters are held with their gradient and two optimizer slots."""

_INPUT_COPIES = 4
"""Batches of ids alive at once (the pipeline's prefetched batch, input dist buffers)."""


class TpuStorageReservation(StorageReservation):
    """Reserves, on every device, the dense parameters (with gradients and optimizer slots), the
    KJT inputs of `_INPUT_COPIES` batches, and `percentage` of HBM for XLA's scratch space."""

    def __init__(self, percentage: float = 0.05) -> None:
        if not 0 <= percentage < 1:
            raise ValueError(f"percentage must be in [0, 1), got {percentage}")
        self._percentage = percentage
        self._last: Topology | None = None
        self.reserved_bytes = 0

    def reserve(self, topology: Topology, batch_size: int, module: nn.Module,
                sharders: list[ModuleSharder[nn.Module]],
                constraints: dict[str, ParameterConstraints] | None = None) -> Topology:
        inputs, shardable = _get_batch_inputs_and_shardable_parameters(module, sharders, batch_size, constraints)
        sharded = {id(p) for m in shardable for p in m.parameters()}
        dense = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in sharded)
        kjt = int(sum(inputs)) * 12 * _INPUT_COPIES
        reserved = copy.deepcopy(topology)
        self.reserved_bytes = dense * DENSE_BYTES_PER_PARAMETER_BYTE + kjt
        for device in reserved.devices:
            device.storage.hbm = int(device.storage.hbm * (1 - self._percentage)) - self.reserved_bytes
        self._last = reserved
        return reserved

    @property
    def last_reserved_topology(self) -> Topology | None:
        return copy.deepcopy(self._last)


class TpuShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner with TPU estimators and placements (see the module docstring)."""

    def __init__(self, topology: TpuTopology, batch_size: int,
                 constraints: dict[str, ParameterConstraints] | None = None,
                 storage_reservation: StorageReservation | None = None, **kwargs: Any) -> None:
        estimators = [TpuPerfEstimator(topology, constraints), TpuStorageEstimator(topology, constraints)]
        enumerator = TpuEmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints,
                                            estimator=estimators)
        kwargs.setdefault("stats", NoopEmbeddingStats())
        kwargs.setdefault("debug", False)
        super().__init__(
            topology=topology,
            batch_size=batch_size,
            enumerator=enumerator,
            storage_reservation=storage_reservation or TpuStorageReservation(),
            constraints=constraints,
            **kwargs,
        )

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        self._check_tables_fit(module, sharders)
        return _with_device_indices(super().plan(module, sharders), self._topology)

    def _check_tables_fit(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> None:
        """Raise, naming the table, when a table's cheapest sharding does not fit one device."""
        capacity = self._storage_reservation.reserve(
            topology=self._topology, batch_size=self._batch_size, module=module, sharders=sharders,
            constraints=self._constraints,
        ).devices[0].storage.hbm
        cheapest: dict[str, tuple[int, str]] = {}
        for option in self._enumerator.enumerate(module=module, sharders=sharders):
            need = max(shard.storage.hbm for shard in option.shards)
            if option.fqn not in cheapest or need < cheapest[option.fqn][0]:
                cheapest[option.fqn] = (need, option.sharding_type)
        for table, (need, sharding_type) in cheapest.items():
            if need > capacity:
                chip = getattr(self._topology, "chip", None)
                raise PlannerError(
                    f"table {table!r} does not fit: its cheapest sharding ({sharding_type}) needs {_gib(need)} of HBM "
                    f"on one device, but a {getattr(chip, 'name', '')} device has {_gib(capacity)} for embeddings "
                    f"(after reserving for dense parameters and inputs): {_gib(need - capacity)} too much. Use more "
                    f"devices, a chip with more HBM, or a smaller table.",
                    PlannerErrorType.INSUFFICIENT_STORAGE,
                )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _with_device_indices(plan: ShardingPlan, topology: Topology) -> ShardingPlan:
    for module_plan in plan.plan.values():
        index_placements(module_plan, topology.local_world_size)
    return plan


def index_placements(parameter_shardings: dict[str, ParameterSharding], local_world_size: int,
                     rank: int | None = None, device: torch.device | None = None) -> None:
    """Give every shard placement without a device index one: `rank:r/tpu:<r mod local world
    size>` (TorchRec leaves devices it does not know without an index), or `device` for the
    shards of `rank` (the device that process drives, whatever its local rank)."""
    for sharding in parameter_shardings.values():
        spec = sharding.sharding_spec
        if not isinstance(spec, EnumerableShardingSpec):
            continue
        shards = []
        for shard in spec.shards:
            where, shard_rank = shard.placement.device(), shard.placement.rank()
            if shard_rank == rank and device is not None:
                where = device
            elif where.index is None:
                where = torch.device(where.type, shard_rank % local_world_size)
            shards.append(ShardMetadata(shard_offsets=shard.shard_offsets, shard_sizes=shard.shard_sizes,
                                        placement=f"rank:{shard_rank}/{where}"))
        sharding.sharding_spec = EnumerableShardingSpec(shards)


def planner(topology: TpuTopology, batch_size: int, constraints: dict[str, ParameterConstraints] | None = None,
            **kwargs: Any) -> TpuShardingPlanner:
    """The planner for `topology`, with `batch_size` samples per device and step."""
    return TpuShardingPlanner(topology, batch_size, constraints, **kwargs)
