"""The benchmark's workload: tables, batches of ids, output gradients, and the SparseCore limits
those batches need.

Every system sees the same batches: `POOL` distinct global batches, drawn once from the seed and
cycled through the steps. Ids in one bag are distinct (as in real multi-hot features), drawn from
the id distribution without replacement. The SparseCore limits are the maxima these batches
need, measured by preprocessing them (feedback-directed, margin 1): no batch overflows a buffer
and no buffer is larger than the workload needs, as after a training job's first limit update.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings.bench.options import BenchConfig, IdDistribution
from embeddings.config import SparseCoreEmbeddingConfig
from sparsecore.layout import round_up, stack_tables
from sparsecore.preprocess import PartitionStats, RaggedIds, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

__all__ = ["POOL", "Batch", "RowSampler", "Workload", "calibrated_configs", "make_workload", "zipf_ids"]

POOL = 8
"""Distinct batches per run; step i uses batch i mod POOL."""

ZIPF_ALPHA = 1.05
_REDRAW_ROUNDS = 32


def zipf_cdf(vocabulary: int, alpha: float) -> np.ndarray:
    """Unnormalised CDF of P(rank k) ~ (k + 1)^-alpha over [0, vocabulary)."""
    return np.cumsum(1.0 / np.arange(1, vocabulary + 1) ** alpha)


def _zipf_ranks(cdf: np.ndarray, rng: np.random.Generator, count: int) -> np.ndarray:
    return np.searchsorted(cdf, rng.random(count) * cdf[-1])


def zipf_ids(rng: np.random.Generator, vocabulary: int, count: int, alpha: float = ZIPF_ALPHA) -> np.ndarray:
    """`count` ids over [0, vocabulary) with P(rank k) ~ (k + 1)^-alpha, ranks hashed to ids by a
    random permutation (with replacement)."""
    ranks = _zipf_ranks(zipf_cdf(vocabulary, alpha), rng, count)
    return rng.permutation(vocabulary)[ranks].astype(np.int64)


class RowSampler:
    """Draws the row ids of one table from an id distribution (a Zipf's rank-to-id permutation is
    fixed when the sampler is made)."""

    def __init__(self, rows: int, distribution: IdDistribution, rng: np.random.Generator) -> None:
        self.rows = rows
        self._cdf = zipf_cdf(rows, distribution.alpha) if distribution.kind == "zipf" else None
        self._ids = rng.permutation(rows) if self._cdf is not None else None

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` ids, with replacement."""
        if self._cdf is None:
            return rng.integers(0, self.rows, count, dtype=np.int64)
        return self._ids[_zipf_ranks(self._cdf, rng, count)].astype(np.int64)

    def draw_distinct(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` distinct ids (sampling without replacement; O(rows), for a few bags only)."""
        if self._cdf is None:
            return rng.choice(self.rows, count, replace=False).astype(np.int64)
        pmf = np.diff(self._cdf, prepend=0.0) / self._cdf[-1]
        return self._ids[rng.choice(self.rows, count, replace=False, p=pmf)].astype(np.int64)

    def bags(self, rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
        """Ids of consecutive bags of `lengths`, distinct within each bag: repeated ids are redrawn
        (rejection, a few rounds), then any bag still holding a repeat is drawn whole without
        replacement."""
        values = self.draw(rng, int(lengths.sum()))
        bag_of = np.repeat(np.arange(len(lengths)), lengths)
        for _ in range(_REDRAW_ROUNDS):
            repeated = _repeated_in_bag(bag_of, values)
            if repeated.size == 0:
                return values
            values[repeated] = self.draw(rng, repeated.size)
        starts = np.cumsum(lengths) - lengths
        for bag in np.unique(bag_of[_repeated_in_bag(bag_of, values)]):
            values[starts[bag] : starts[bag] + lengths[bag]] = self.draw_distinct(rng, int(lengths[bag]))
        return values


def _repeated_in_bag(bag_of: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Positions holding an id already seen earlier (in sorted order) in the same bag."""
    order = np.lexsort((values, bag_of))
    bags, ids = bag_of[order], values[order]
    same = (bags[1:] == bags[:-1]) & (ids[1:] == ids[:-1])
    return order[1:][same]


@dataclass(frozen=True)
class Batch:
    """One global batch: per table (feature f<t>), each sample's bag length and the flat ids, and
    the gradient of the pooled output `[batch, tables * dim]` (training only)."""

    lengths: tuple[np.ndarray, ...]
    ids: tuple[np.ndarray, ...]
    output_grad: np.ndarray | None

    @property
    def lookups(self) -> int:
        return int(sum(ids.size for ids in self.ids))

    def _parts(self, samples: slice) -> list[tuple[np.ndarray, np.ndarray]]:
        parts = []
        for lengths, ids in zip(self.lengths, self.ids):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            parts.append((lengths[samples], ids[offsets[samples.start] : offsets[samples.stop]]))
        return parts

    def kjt(self, samples: slice) -> KeyedJaggedTensor:
        """Samples [start, stop) of every feature as a TorchRec KJT."""
        parts = self._parts(samples)
        return KeyedJaggedTensor(
            keys=[f"f{t}" for t in range(len(parts))],
            values=torch.from_numpy(np.concatenate([ids for _, ids in parts])),
            lengths=torch.from_numpy(np.concatenate([lengths for lengths, _ in parts]).astype(np.int64)),
        )

    def ragged(self, samples: slice) -> dict[str, RaggedIds]:
        """Samples [start, stop) of every feature as `sparsecore` ragged ids."""
        return {f"f{t}": RaggedIds(ids, lengths=lengths) for t, (lengths, ids) in enumerate(self._parts(samples))}


@dataclass(frozen=True)
class Workload:
    """The tables (TorchRec configs, feature f<t> reads table t<t>) and the batches of a run."""

    config: BenchConfig
    tables: tuple[EmbeddingBagConfig, ...]
    batches: tuple[Batch, ...]

    @property
    def mean_lookups(self) -> float:
        """Ids per global batch, averaged over the batches."""
        return float(np.mean([batch.lookups for batch in self.batches]))


def make_workload(config: BenchConfig) -> Workload:
    """Tables and `POOL` batches drawn from `config.seed` (the same on every process)."""
    rng = np.random.default_rng(config.seed)
    pooling = PoolingType.SUM if config.combiner == "sum" else PoolingType.MEAN
    tables = tuple(
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=rows, embedding_dim=config.dim, feature_names=[f"f{t}"], pooling=pooling
        )
        for t, rows in enumerate(config.rows)
    )
    samplers = [RowSampler(rows, config.id_distribution, rng) for rows in config.rows]
    bag_lengths = config.ids_per_bag
    batches = []
    for _ in range(POOL):
        lengths = [rng.integers(bag_lengths.low, bag_lengths.high + 1, config.batch_size) for _ in samplers]
        ids = [sampler.bags(rng, length) for sampler, length in zip(samplers, lengths)]
        grad = (
            rng.standard_normal((config.batch_size, config.tables * config.dim)).astype(np.float32)
            if config.training
            else None
        )
        batches.append(Batch(tuple(lengths), tuple(ids), grad))
    return Workload(config, tables, tuple(batches))


def host_samples(config: BenchConfig, host: int) -> slice:
    """The samples of the global batch that process `host` feeds."""
    per_host = config.batch_size // config.processes
    return slice(host * per_host, (host + 1) * per_host)


def calibrated_configs(workload: Workload, topology: Topology) -> list[SparseCoreEmbeddingConfig]:
    """Each table with the limits the workload needs: the maxima over every batch and every
    process's samples of the ids (and distinct ids) one SparseCore sends to one partition, and of
    the COO buffer a device needs. Per-table maxima do not depend on stacking (stacking rotates
    which SparseCore holds a row, not how many ids a partition gets), so each table is measured
    as a stack of its own; a stack's limits are then its tables' sums."""
    config = workload.config
    samples_per_sparsecore = config.batch_size // topology.num_sparsecores
    generous = samples_per_sparsecore * config.ids_per_bag.high
    buffer = topology.sparsecores_per_device * round_up(generous + 8 * topology.num_sparsecores, 8)
    features = [
        FeatureSpec(
            f"f{t}",
            TableSpec(
                table.name,
                table.num_embeddings,
                table.embedding_dim,
                max_ids_per_partition=generous,
                max_unique_ids_per_partition=generous,
                suggested_coo_buffer_size_per_device=buffer,
            ),
            config.batch_size,
        )
        for t, table in enumerate(workload.tables)
    ]
    stacks = stack_tables(features, topology)
    stats: dict[str, PartitionStats] = {}
    for batch in workload.batches:
        for host in range(config.processes):
            packed = preprocess(stacks, batch.ragged(host_samples(config, host)), topology)
            for name, part in packed.items():
                stats[name] = part.stats if name not in stats else stats[name].merge(part.stats)
    stack_of = {stack.table_names[0]: stack.name for stack in stacks}
    configs = []
    for table in workload.tables:
        observed = stats[stack_of[table.name]]
        configs.append(
            SparseCoreEmbeddingConfig(
                table,
                max_ids_per_partition=max(1, observed.table_max_ids_per_partition[table.name]),
                max_unique_ids_per_partition=max(1, observed.table_max_unique_ids_per_partition[table.name]),
                suggested_coo_buffer_size_per_device=max(8, observed.required_buffer_size_per_device),
            )
        )
    return configs
