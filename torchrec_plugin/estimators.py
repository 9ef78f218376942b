"""What a shard costs on a TPU device: HBM bytes and milliseconds, for TorchRec's planner.

Storage counts what lives in HBM for a shard of `[rows, cols]` (never 0 bytes):

* SparseCore (FUSED) shards: the table padded as SparseCore lays it out (rows to a multiple of
  8 x SparseCores per device, columns to the chip's alignment), its optimizer slots (same rows;
  full width for Adagrad, one column for row-wise Adagrad, two full for Adam), the TorchRec-layout
  mirror of the shard (`torchrec_plugin.kernels`), the static per-step buffers (16 bytes per id:
  id, sample, gain, unique index; sized for `ID_HEADROOM` x the expected ids), the gradient
  workspace (one padded row per expected id) and the activations with their gradients.
* Data-parallel (DENSE) shards: the table, its gradient, two dense optimizer slots, activations.

An `EmbeddingCollection`'s (unpooled) shards output one row per id instead of one per sample and
feature; on SparseCore a sequence feature's activations are a static `[samples, max_seq_len]`
block (`torchrec_plugin.sequence_lengths`), so its FUSED shards count that block, with the
`max_seq_len` the sharder is given for the table.

Perf (TorchRec's `Perf`, in ms) comes from the topology's bandwidths: the lookup streams the
shard's id buffers, reads one padded row per id and writes the pooled outputs (HBM bandwidth);
row-split tables first bucketize their ids by row range; the fused update streams the id buffers
again and reads and writes the touched rows and their slots; the collectives move ids and pooled
outputs over ICI within a slice (DCN across slices); data-parallel tables all-reduce their
gradients. On one device, where every sharding puts all rows in one place, these make the
planner keep each table whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.types import ShardingType

from sparsecore.layout import round_up
from torchrec_plugin.hardware import TpuTopology
from torchrec_plugin.sequence_lengths import MAX_SEQ_LEN, sequence_lengths

__all__ = ["ID_HEADROOM", "ShardCost", "TpuPerfEstimator", "TpuStorageEstimator", "shard_cost"]

ID_HEADROOM = 1.25
"""Static buffers are sized for this many times the expected ids of a step."""

_F32 = 4
_ID_BYTES = 8
_BUFFER_BYTES_PER_ID = 16
_SLOT_WIDTHS = {"sgd": (0, 0), "adagrad": (1, 0), "rowwise_adagrad": (0, 1), "adam": (2, 0)}
"""Optimizer -> (full-width slots, one-column slots)."""

_ROW_SPLIT = {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value}


def optimizer_name(option: ShardingOption) -> str:
    """The fused optimizer of the option's table, from `apply_optimizer_in_backward` (SGD, as
    FBGEMM, when none is set)."""
    classes = getattr(option.tensor, "_optimizer_classes", None) or [None]
    name = getattr(classes[0], "__name__", "SGD").lower()
    return {"rowwiseadagrad": "rowwise_adagrad"}.get(name, name if name in _SLOT_WIDTHS else "sgd")


@dataclass(frozen=True)
class ShardCost:
    """One shard's HBM bytes by purpose and its perf."""

    table: int
    optimizer: int
    mirror: int
    buffers: int
    activations: int
    perf: Perf

    @property
    def hbm(self) -> int:
        return self.table + self.optimizer + self.mirror + self.buffers + self.activations


def _ids_per_step(option: ShardingOption, global_batch: int, row_shards: int) -> float:
    """Expected ids a shard looks up per step (row-split tables see 1/row_shards of them)."""
    return global_batch * sum(option.input_lengths) / row_shards


def _comms_bandwidth(topology: Topology) -> float:
    return topology.intra_host_bw if topology.world_size <= topology.local_world_size else topology.inter_host_bw


def shard_cost(option: ShardingOption, size: list[int], topology: TpuTopology,
               max_seq_len: int | None = None) -> ShardCost:
    """HBM and perf of one shard of `option` of `size` = [rows, cols] (see the module docstring);
    `max_seq_len` is needed for the FUSED shards of an unpooled (sequence) table."""
    rows, cols = size
    features = option.num_inputs
    hbm_bw, comms_bw = topology.hbm_mem_bw, _comms_bandwidth(topology)
    pooled = option.is_pooled
    if option.sharding_type == ShardingType.DATA_PARALLEL.value:
        ids = option.batch_size * sum(option.input_lengths)
        outputs = (option.batch_size * features if pooled else ids) * cols * _F32
        table = rows * cols * _F32
        perf = Perf(
            fwd_compute=(ids * cols * _F32 + outputs) / hbm_bw,
            fwd_comms=0.0,
            bwd_compute=(2 * ids * cols * _F32 + outputs) / hbm_bw,
            bwd_comms=2 * table / comms_bw,
        )
        return ShardCost(table=table + table, optimizer=2 * table, mirror=0, buffers=0,
                         activations=2 * outputs, perf=perf)
    if not pooled and max_seq_len is None:
        raise ValueError(f"table {option.name!r}: the cost of a sequence table's SparseCore shard needs max_seq_len")
    chip = topology.chip
    padded_rows = round_up(max(rows, 1), 8 * chip.sparsecores_per_device)
    padded_cols = round_up(cols, chip.embedding_dim_alignment)
    global_batch = option.batch_size * topology.world_size
    row_shards = len(option.shards) if option.sharding_type in _ROW_SPLIT else 1
    ids = _ids_per_step(option, global_batch, row_shards)
    static_ids = math.ceil(ids * ID_HEADROOM)
    full, narrow = _SLOT_WIDTHS[optimizer_name(option)]
    rows_out = global_batch * features * (1 if pooled else max_seq_len)
    outputs = rows_out * padded_cols * _F32
    sent = (global_batch * features if pooled else global_batch * sum(option.input_lengths)) * cols * _F32
    row_bytes = padded_cols * _F32
    # A row-split table's ids are bucketized by row range before they are sent (read and
    # written once), and the host then reads the bucket counts back to size the all-to-all.
    bucketize = 2 * ids * _ID_BYTES if option.sharding_type in _ROW_SPLIT else 0
    # Each shard's lookup and update stream its id buffers, however narrow the shard: every
    # column shard of a table reads all of the table's ids.
    id_buffers = ids * _BUFFER_BYTES_PER_ID
    perf = Perf(
        fwd_compute=(ids * row_bytes + id_buffers + outputs + bucketize) / hbm_bw,
        fwd_comms=sent / comms_bw,
        bwd_compute=(ids * row_bytes * (2 + 2 * full) + ids * narrow * 2 * _F32 + id_buffers + outputs) / hbm_bw,
        bwd_comms=sent / comms_bw,
        input_dist_comms=(ids * _ID_BYTES) / comms_bw,
    )
    return ShardCost(
        table=padded_rows * row_bytes,
        optimizer=padded_rows * (full * padded_cols + narrow) * _F32,
        mirror=rows * cols * _F32,
        buffers=static_ids * (_BUFFER_BYTES_PER_ID + row_bytes),
        activations=2 * outputs,
        perf=perf,
    )


def _max_seq_len(option: ShardingOption, sharder_data_map) -> int | None:
    """The `max_seq_len` the option's sharder sets for its table (unpooled FUSED options only)."""
    if option.is_pooled or option.sharding_type == ShardingType.DATA_PARALLEL.value:
        return None
    data = (sharder_data_map or {}).get(option.module_type_key)
    setting = (data.fused_params or {}).get(MAX_SEQ_LEN) if data is not None else None
    return sequence_lengths(setting, [option.name])[option.name]


class _TpuEstimator(ShardEstimator):
    def __init__(self, topology: Topology, constraints: dict[str, ParameterConstraints] | None = None) -> None:
        if not isinstance(topology, TpuTopology):
            raise TypeError(f"the tpu estimators need a TpuTopology (torchrec_plugin.topology(...)), got {type(topology)}")
        self._topology = topology
        self._constraints = constraints


class TpuStorageEstimator(_TpuEstimator):
    """Per-shard HBM (see the module docstring); nothing in host memory."""

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        for option in sharding_options:
            max_seq_len = _max_seq_len(option, sharder_data_map)
            for shard in option.shards:
                shard.storage = Storage(hbm=shard_cost(option, shard.size, self._topology, max_seq_len).hbm, ddr=0)


class TpuPerfEstimator(_TpuEstimator):
    """Per-shard perf from the topology's HBM and ICI/DCN bandwidths."""

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        for option in sharding_options:
            max_seq_len = _max_seq_len(option, sharder_data_map)
            for shard in option.shards:
                shard.perf = shard_cost(option, shard.size, self._topology, max_seq_len).perf
