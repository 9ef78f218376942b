"""MOD sharding and table stacking: where every row of every table lives on the SparseCores.

With N SparseCores in all, row r of a table lives on SparseCore (shard) `r mod N` at local row
`r div N` ("MOD sharding"); vocabularies are padded to a multiple of 8N and dims to the chip's
alignment. Tables that share a padded dim, optimizer and combiner may be *stacked* (under an
optimizer with row-wise slots also their own dim, which its row update averages over): each is
placed in every shard at `row_offset_in_shard` and its shards are rotated by `shard_rotation`
(k * rotation mod N for the k-th table) so that hot low ids of different tables land on different
SparseCores. Features reading tables of one stack are looked up as one batch, each at its
`row_offset` in the stack's samples (feature stacking).

Everything here is NumPy and pure index arithmetic; the golden data of jax-tpu-embedding 0.2.0
(tests/sparsecore/golden) fixes the conventions. Unlike that library, a stack keeps the per-table
limits of its tables: its own limits default to their sum, never to an unrelated constant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sparsecore.spec import Combiner, FeatureSpec, TableSpec, optimizer_key
from sparsecore.topology import Topology

if TYPE_CHECKING:
    from sparsecore.optimizers import OptimizerSpec

__all__ = [
    "DEFAULT_ACTIVATION_MEMORY_LIMIT_BYTES",
    "FeaturePlacement",
    "StackGroup",
    "StackedTable",
    "TablePlacement",
    "auto_stack_groups",
    "auto_stack_tables",
    "flatten_features",
    "padded_embedding_dim",
    "padded_vocabulary_size",
    "physical_row_ids",
    "round_up",
    "shard_and_local_row",
    "shard_table",
    "stack_and_shard",
    "stack_tables",
    "unshard_and_unstack",
    "unshard_table",
]

_INT32_PAD = 2**31 - 1
"""Embedding and sample ids are int32 in the buffers, and this value is their pad."""

DEFAULT_ACTIVATION_MEMORY_LIMIT_BYTES = 2 * 1024 * 1024
"""Auto-stacking keeps each stack's activations per SparseCore under this (the anchor's default)."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_vocabulary_size(vocabulary_size: int, num_sparsecores: int) -> int:
    """Rows after padding: a multiple of 8 per shard, i.e. of 8N."""
    return round_up(vocabulary_size, 8 * num_sparsecores)


def padded_embedding_dim(embedding_dim: int, alignment: int) -> int:
    return round_up(embedding_dim, alignment)


def _shard_counts(topology: Topology) -> tuple[int, int, int]:
    return topology.global_device_count, topology.sparsecores_per_device, topology.num_sparsecores


def shard_table(table: np.ndarray, topology: Topology) -> np.ndarray:
    """MOD-shard one unpadded table [V, ...] into the per-device view [G, S*V/N, ...].

    `out[d, s*(V/N) + i] = table[i*N + d*S + s]`: SparseCore g = d*S + s holds rows r = g mod N
    at local index r div N. V must already be a multiple of N (this function does not pad).
    """
    devices, per_device, n = _shard_counts(topology)
    table = np.asarray(table)
    if table.shape[0] % n:
        raise ValueError(
            f"shard_table: {table.shape[0]} rows are not a multiple of the {n} SparseCores; "
            "pad the vocabulary first (padded_vocabulary_size)"
        )
    rows = table.shape[0] // n
    shards = np.swapaxes(table.reshape(rows, n, *table.shape[1:]), 0, 1)
    return shards.reshape(devices, per_device * rows, *table.shape[1:])


def unshard_table(sharded: np.ndarray, topology: Topology) -> np.ndarray:
    """Inverse of `shard_table`: [G, S*V/N, ...] back to [V, ...]."""
    devices, per_device, n = _shard_counts(topology)
    sharded = np.asarray(sharded)
    if sharded.shape[0] != devices or sharded.shape[1] % per_device:
        raise ValueError(
            f"unshard_table: shape {sharded.shape} is not [{devices}, {per_device} * rows, ...]"
        )
    rows = sharded.shape[1] // per_device
    shards = sharded.reshape(n, rows, *sharded.shape[2:])
    return np.swapaxes(shards, 0, 1).reshape(n * rows, *sharded.shape[2:])


@dataclass(frozen=True)
class TablePlacement:
    """Where one table sits in its stack: rows [row_offset_in_shard, + rows_in_shard) of every
    shard, with shard k of the table stored on shard (k + shard_rotation) mod N."""

    table: TableSpec
    padded_vocabulary_size: int
    rows_in_shard: int
    row_offset_in_shard: int
    shard_rotation: int


@dataclass(frozen=True)
class FeaturePlacement:
    """How one feature enters its stack's lookup.

    Its output rows occupy stack samples [row_offset, row_offset + feature.num_rows); every
    SparseCore gets `samples_per_sparsecore` of them, numbered from `sample_offset_in_sparsecore`
    in that SparseCore's batch. An id e becomes stacked column
    `((e + col_shift) mod N) + (e - e mod N) + col_offset`.
    """

    feature: FeatureSpec
    table_index: int
    row_offset: int
    col_offset: int
    col_shift: int
    samples_per_sparsecore: int
    sample_offset_in_sparsecore: int


@dataclass(frozen=True)
class StackedTable:
    """One stacked (possibly single) table, the unit the kernels and buffers work on.

    `tables` keep their own `TableSpec`s, per-table limits included; `embedding_dim` is their
    widest dim padded to the chip's alignment; `max_ids_per_partition` and
    `max_unique_ids_per_partition` are the limits of the whole stack (what one SparseCore may
    send to one partition) and size its buffers. Every SparseCore's batch holds the `features`'
    samples one feature after another, in their order and with no gap (checked here; the torch
    modules regroup activations by it).
    """

    name: str
    num_sparsecores: int
    embedding_dim: int
    tables: tuple[TablePlacement, ...]
    features: tuple[FeaturePlacement, ...]
    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    suggested_coo_buffer_size_per_device: int | None = None

    def __post_init__(self) -> None:
        for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
            if getattr(self, field) <= 0:
                raise ValueError(f"stack {self.name!r}: {field} must be positive")
        size = self.suggested_coo_buffer_size_per_device
        if size is not None and size <= 0:
            raise ValueError(
                f"stack {self.name!r}: suggested_coo_buffer_size_per_device must be positive"
            )
        start = 0
        for placement in self.features:
            if placement.sample_offset_in_sparsecore != start:
                raise ValueError(
                    f"stack {self.name!r}: feature {placement.feature.name!r} starts at sample "
                    f"{placement.sample_offset_in_sparsecore} of each SparseCore's batch, expected "
                    f"{start} (features follow one another in order)"
                )
            start += placement.samples_per_sparsecore
        if start != self.batch_size_per_sparsecore:
            raise ValueError(
                f"stack {self.name!r}: its features fill {start} samples of each SparseCore's "
                f"batch of {self.batch_size_per_sparsecore}"
            )
        for what, value in (
            ("rows per shard", self.rows_per_shard),
            ("samples per SparseCore", self.batch_size_per_sparsecore),
        ):
            if value >= _INT32_PAD:
                raise ValueError(
                    f"stack {self.name!r}: {value} {what} do not fit the int32 buffers "
                    f"(at most {_INT32_PAD - 1}); use more SparseCores or split the stack"
                )

    @property
    def vocabulary_size(self) -> int:
        """Rows of the stacked variable: the sum of padded vocabularies."""
        return sum(t.padded_vocabulary_size for t in self.tables)

    @property
    def rows_per_shard(self) -> int:
        return self.vocabulary_size // self.num_sparsecores

    @property
    def logical_embedding_dim(self) -> int:
        """Columns of the widest table's own rows (the rest of `embedding_dim` is padding); under
        an optimizer with row-wise slots every table of the stack has this dim."""
        return max(t.table.embedding_dim for t in self.tables)

    @property
    def combiner(self) -> Combiner:
        return self.tables[0].table.combiner

    @property
    def optimizer(self) -> OptimizerSpec:
        return self.tables[0].table.optimizer

    @property
    def total_sample_count(self) -> int:
        """Output rows per global step over all features of the stack."""
        return sum(f.feature.num_rows for f in self.features)

    @property
    def batch_size_per_sparsecore(self) -> int:
        return self.total_sample_count // self.num_sparsecores

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.table.name for t in self.tables)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.feature.name for f in self.features)

    def table(self, name: str) -> TablePlacement:
        for placement in self.tables:
            if placement.table.name == name:
                return placement
        raise KeyError(f"stack {self.name!r} has no table {name!r}; it has {self.table_names}")

    def with_limits(
        self,
        max_ids_per_partition: int,
        max_unique_ids_per_partition: int,
        suggested_coo_buffer_size_per_device: int | None,
        table_limits: Mapping[str, tuple[int, int]] | None = None,
    ) -> StackedTable:
        """A copy with new stack limits and, per table name, new (max_ids, max_unique_ids)."""
        tables = self.tables
        if table_limits:
            tables = tuple(
                (
                    dataclasses.replace(p, table=p.table.with_limits(*table_limits[p.table.name]))
                    if p.table.name in table_limits
                    else p
                )
                for p in self.tables
            )
        features = tuple(
            dataclasses.replace(
                f, feature=dataclasses.replace(f.feature, table=tables[f.table_index].table)
            )
            for f in self.features
        )
        return dataclasses.replace(
            self,
            tables=tables,
            features=features,
            max_ids_per_partition=max_ids_per_partition,
            max_unique_ids_per_partition=max_unique_ids_per_partition,
            suggested_coo_buffer_size_per_device=suggested_coo_buffer_size_per_device,
        )


@dataclass(frozen=True)
class StackGroup:
    """Tables to stack together, in this order, with optional overrides of the stack's settings.

    Unset limits default to the sums of the tables' own limits; unset rotation to the
    topology's SparseCores per device; an unset name to the table names joined with "_".
    """

    tables: tuple[str, ...]
    name: str | None = None
    rotation: int | None = None
    max_ids_per_partition: int | None = None
    max_unique_ids_per_partition: int | None = None
    suggested_coo_buffer_size_per_device: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        if not self.tables:
            raise ValueError("StackGroup needs at least one table")
        repeated = sorted({t for t in self.tables if self.tables.count(t) > 1})
        if repeated:
            raise ValueError(f"StackGroup {self.tables}: table(s) {repeated} repeated")
        for field in (
            "max_ids_per_partition",
            "max_unique_ids_per_partition",
            "suggested_coo_buffer_size_per_device",
        ):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"StackGroup {self.tables}: {field} must be positive, got {value}")


def flatten_features(
    features: Sequence[FeatureSpec] | Mapping[str, FeatureSpec],
) -> tuple[FeatureSpec, ...]:
    """The feature order every stacking rule uses: a sequence as given, a mapping by sorted key
    (as `jax.tree` flattens a dict). Feature names must be unique."""
    if isinstance(features, Mapping):
        flat = tuple(features[key] for key in sorted(features))
    else:
        flat = tuple(features)
    names = [f.name for f in flat]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"feature name(s) {repeated} used more than once")
    return flat


def _tables_by_first_use(features: Sequence[FeatureSpec]) -> dict[str, TableSpec]:
    tables: dict[str, TableSpec] = {}
    for feature in features:
        known = tables.setdefault(feature.table.name, feature.table)
        if known != feature.table:
            raise ValueError(
                f"two different tables are named {feature.table.name!r} "
                f"(feature {feature.name!r} reads one of them)"
            )
    return tables


def _check_feature_batch(feature: FeatureSpec, topology: Topology) -> None:
    n = topology.num_sparsecores
    if feature.num_rows % n:
        raise ValueError(
            f"feature {feature.name!r}: its {feature.num_rows} output rows per step cannot be "
            f"split evenly over the {n} SparseCores ({topology.global_device_count} devices x "
            f"{topology.sparsecores_per_device} SparseCores per device); the batch per device must "
            "be divisible by the SparseCores per device"
        )


def _has_row_wise_slots(optimizer: OptimizerSpec) -> bool:
    return any(slot.per_row for slot in optimizer.slots())


def _build_stack(
    group: StackGroup,
    tables: Mapping[str, TableSpec],
    features: Sequence[FeatureSpec],
    topology: Topology,
) -> StackedTable:
    n = topology.num_sparsecores
    name = group.name or "_".join(group.tables)
    specs = [tables[t] for t in group.tables]
    first = specs[0]
    for spec in specs[1:]:
        if spec.combiner != first.combiner:
            raise ValueError(
                f"stack {name!r}: table {spec.name!r} uses combiner {spec.combiner.value!r} but "
                f"{first.name!r} uses {first.combiner.value!r}; a stack has one combiner"
            )
        if optimizer_key(spec.optimizer) != optimizer_key(first.optimizer):
            raise ValueError(
                f"stack {name!r}: table {spec.name!r} uses optimizer {spec.optimizer!r} but "
                f"{first.name!r} uses {first.optimizer!r}; a stack has one optimizer"
            )
        if spec.embedding_dim != first.embedding_dim and _has_row_wise_slots(first.optimizer):
            raise ValueError(
                f"stack {name!r}: table {spec.name!r} has dim {spec.embedding_dim} but {first.name!r} "
                f"has {first.embedding_dim}; {type(first.optimizer).__name__}'s row-wise slot averages "
                "each row's squared gradient over one dim per stack, so stack only tables of one dim "
                "under it"
            )
    rotation = topology.sparsecores_per_device if group.rotation is None else group.rotation
    placements = []
    row_offset_in_shard = 0
    for k, spec in enumerate(specs):
        padded = padded_vocabulary_size(spec.vocabulary_size, n)
        placements.append(
            TablePlacement(
                table=spec,
                padded_vocabulary_size=padded,
                rows_in_shard=padded // n,
                row_offset_in_shard=row_offset_in_shard,
                shard_rotation=(k * rotation) % n,
            )
        )
        row_offset_in_shard += padded // n
    index = {p.table.name: i for i, p in enumerate(placements)}
    feature_placements = []
    row_offset = 0
    for feature in features:
        if feature.table.name not in index:
            continue
        _check_feature_batch(feature, topology)
        table = placements[index[feature.table.name]]
        feature_placements.append(
            FeaturePlacement(
                feature=feature,
                table_index=index[feature.table.name],
                row_offset=row_offset,
                col_offset=table.row_offset_in_shard * n,
                col_shift=table.shard_rotation,
                samples_per_sparsecore=feature.num_rows // n,
                sample_offset_in_sparsecore=row_offset // n,
            )
        )
        row_offset += feature.num_rows
    alignment = topology.embedding_dim_alignment
    buffer = group.suggested_coo_buffer_size_per_device
    if buffer is None and all(s.suggested_coo_buffer_size_per_device for s in specs):
        buffer = sum(s.suggested_coo_buffer_size_per_device for s in specs)
    return StackedTable(
        name=name,
        num_sparsecores=n,
        embedding_dim=max(padded_embedding_dim(s.embedding_dim, alignment) for s in specs),
        tables=tuple(placements),
        features=tuple(feature_placements),
        max_ids_per_partition=(
            group.max_ids_per_partition or sum(s.max_ids_per_partition for s in specs)
        ),
        max_unique_ids_per_partition=(
            group.max_unique_ids_per_partition or sum(s.max_unique_ids_per_partition for s in specs)
        ),
        suggested_coo_buffer_size_per_device=buffer,
    )


def stack_tables(
    features: Sequence[FeatureSpec] | Mapping[str, FeatureSpec],
    topology: Topology,
    groups: Sequence[StackGroup] = (),
) -> tuple[StackedTable, ...]:
    """Stack the tables of `features` as `groups` say; every other table is a stack of its own.

    Stacks come in the order their first table is first used by a feature. Features of one
    stack get row offsets in feature order (see `flatten_features`).
    """
    flat = flatten_features(features)
    tables = _tables_by_first_use(flat)
    grouped: dict[str, StackGroup] = {}
    for group in groups:
        for table in group.tables:
            if table not in tables:
                raise ValueError(
                    f"StackGroup {group.tables}: no feature reads table {table!r}; "
                    f"tables read: {sorted(tables)}"
                )
            if table in grouped:
                raise ValueError(
                    f"table {table!r} is in two stack groups: {grouped[table].tables} and "
                    f"{group.tables}"
                )
            grouped[table] = group
    ordered: list[StackGroup] = []
    for table in tables:
        group = grouped.get(table, StackGroup((table,)))
        if group not in ordered:
            ordered.append(group)
    stacks = tuple(_build_stack(g, tables, flat, topology) for g in ordered)
    names = [s.name for s in stacks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"stack name(s) {repeated} used more than once")
    return stacks


def auto_stack_groups(
    features: Sequence[FeatureSpec] | Mapping[str, FeatureSpec],
    topology: Topology,
    activation_memory_limit_bytes: int = DEFAULT_ACTIVATION_MEMORY_LIMIT_BYTES,
    rotation: int | None = None,
) -> tuple[StackGroup, ...]:
    """Group tables that can share a stack: same padded dim, optimizer and combiner, and under an
    optimizer with row-wise slots the same dim too.

    Tables are taken in order of first use. Each table's activation bytes per SparseCore are
    padded_dim * (its features' rows / N) * 4; a group is split first-fit so that no stack
    exceeds `activation_memory_limit_bytes` (a table larger than the limit stacks alone).
    """
    flat = flatten_features(features)
    tables = _tables_by_first_use(flat)
    n = topology.num_sparsecores
    alignment = topology.embedding_dim_alignment
    rows: dict[str, int] = dict.fromkeys(tables, 0)
    for feature in flat:
        rows[feature.table.name] += feature.num_rows // n
    by_kind: dict[tuple, list[str]] = {}
    for name, spec in tables.items():
        dim = padded_embedding_dim(spec.embedding_dim, alignment)
        own_dim = spec.embedding_dim if _has_row_wise_slots(spec.optimizer) else None
        by_kind.setdefault((dim, own_dim, optimizer_key(spec.optimizer), spec.combiner), []).append(name)
    groups: list[StackGroup] = []
    for (dim, *_), names in by_kind.items():
        bins: list[list[str]] = []
        used: list[int] = []
        for name in names:
            nbytes = dim * rows[name] * 4
            limit = activation_memory_limit_bytes
            fits = [i for i in range(len(bins)) if used[i] + nbytes <= limit]
            if fits:
                bins[fits[0]].append(name)
                used[fits[0]] += nbytes
            else:
                bins.append([name])
                used.append(nbytes)
        groups.extend(StackGroup(tuple(members), rotation=rotation) for members in bins)
    return tuple(groups)


def auto_stack_tables(
    features: Sequence[FeatureSpec] | Mapping[str, FeatureSpec],
    topology: Topology,
    activation_memory_limit_bytes: int = DEFAULT_ACTIVATION_MEMORY_LIMIT_BYTES,
    rotation: int | None = None,
) -> tuple[StackedTable, ...]:
    """`stack_tables` with the groups of `auto_stack_groups`."""
    groups = auto_stack_groups(features, topology, activation_memory_limit_bytes, rotation)
    return stack_tables(features, topology, groups)


def shard_and_local_row(
    stack: StackedTable, table: str, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(shard, local row in that shard) of rows of `table`: the pair the preprocessing emits as
    (partition, embedding id) for the same id."""
    placement = stack.table(table)
    rows = np.asarray(rows, dtype=np.int64)
    n = stack.num_sparsecores
    shard = (rows + placement.shard_rotation) % n
    return shard, placement.row_offset_in_shard + rows // n


def physical_row_ids(stack: StackedTable, table: str, rows: np.ndarray | None = None) -> np.ndarray:
    """Row of the stacked variable [N * rows_per_shard, dim] holding each row of `table`
    (all rows when `rows` is None)."""
    if rows is None:
        rows = np.arange(stack.table(table).table.vocabulary_size)
    shard, local = shard_and_local_row(stack, table, rows)
    return shard * stack.rows_per_shard + local


def _check_rows(
    stack: StackedTable, placement: TablePlacement, values: np.ndarray, per_row: bool
) -> None:
    spec = placement.table
    expected = (spec.vocabulary_size,) if per_row else (spec.vocabulary_size, spec.embedding_dim)
    trailing_ok = values.shape[1:] in ((), (1,)) if per_row else values.ndim == 2
    if values.shape[: len(expected)] != expected or not trailing_ok:
        what = "[V] or [V, 1]" if per_row else "[V, dim]"
        raise ValueError(
            f"stack {stack.name!r}, table {spec.name!r}: expected {what} = {expected}, "
            f"got shape {values.shape}"
        )


def stack_and_shard(
    stack: StackedTable,
    values: Mapping[str, np.ndarray],
    pad_value: float = np.nan,
    per_row: bool = False,
) -> np.ndarray:
    """Place the tables' values into the stacked, MOD-sharded layout [N, rows_per_shard, ...].

    `values[name]` is [V, dim] (a table or an element-wise optimizer slot; output
    [N, rows, stack dim]) or, with `per_row`, a row-wise slot [V] or [V, 1] (output [N, rows] or
    [N, rows, 1]). Padding rows and columns hold `pad_value`. Reshaping the result to
    [N * rows_per_shard, ...] gives the stacked variable; device d holds shards [d*S, (d+1)*S).
    """
    missing = sorted(set(stack.table_names) - set(values))
    extra = sorted(set(values) - set(stack.table_names))
    if missing or extra:
        raise ValueError(f"stack {stack.name!r}: missing values for {missing}, unexpected {extra}")
    n = stack.num_sparsecores
    arrays = {name: np.asarray(values[name]) for name in stack.table_names}
    first = arrays[stack.table_names[0]]
    trailing = first.shape[1:] if per_row else (stack.embedding_dim,)
    dtype = np.result_type(*arrays.values(), np.float32)
    out = np.full((n, stack.rows_per_shard, *trailing), pad_value, dtype=dtype)
    for placement in stack.tables:
        table = arrays[placement.table.name]
        _check_rows(stack, placement, table, per_row)
        padded = np.full((placement.padded_vocabulary_size, *trailing), pad_value, dtype=dtype)
        if per_row:
            padded[: table.shape[0]] = table.reshape(table.shape[0], *trailing)
        else:
            padded[: table.shape[0], : table.shape[1]] = table
        shards = np.swapaxes(padded.reshape(placement.rows_in_shard, n, *trailing), 0, 1)
        start = placement.row_offset_in_shard
        rotated = np.roll(shards, placement.shard_rotation, axis=0)
        out[:, start : start + placement.rows_in_shard] = rotated
    return out


def unshard_and_unstack(
    stack: StackedTable, stacked: np.ndarray, per_row: bool = False
) -> dict[str, np.ndarray]:
    """Inverse of `stack_and_shard`: from [N, rows_per_shard, ...] (or the [N * rows, ...]
    stacked variable) back to each table's unpadded values, by table name."""
    n = stack.num_sparsecores
    stacked = np.asarray(stacked)
    if stacked.shape[0] == n * stack.rows_per_shard and stacked.shape[0] != n:
        stacked = stacked.reshape(n, stack.rows_per_shard, *stacked.shape[1:])
    if stacked.shape[:2] != (n, stack.rows_per_shard):
        raise ValueError(
            f"stack {stack.name!r}: expected [{n}, {stack.rows_per_shard}, ...] or "
            f"[{n * stack.rows_per_shard}, ...], got shape {stacked.shape}"
        )
    tables = {}
    for placement in stack.tables:
        start = placement.row_offset_in_shard
        shards = stacked[:, start : start + placement.rows_in_shard]
        shards = np.roll(shards, -placement.shard_rotation, axis=0)
        padded = np.swapaxes(shards, 0, 1).reshape(
            placement.padded_vocabulary_size, *stacked.shape[2:]
        )
        spec = placement.table
        tables[spec.name] = (
            padded[: spec.vocabulary_size].copy()
            if per_row
            else padded[: spec.vocabulary_size, : spec.embedding_dim].copy()
        )
    return tables
