"""Host input preprocessing: a TorchRec `KeyedJaggedTensor` -> the packed SparseCore buffers on `tpu`.

`SparseCorePreprocessor` checks a KJT against the module's features (keys, batch size, weights),
hands every feature's ragged ids to `sparsecore.preprocess` (one vectorised call for all stacks),
and moves each stack's buffers to the mesh as sharded `tpu` tensors (this process's part of the
global batch; every process feeds its own samples). The result, a `SparseCoreBatch`, is what the
modules' lookup consumes; it is plain data, so a prefetching loader can build it ahead of time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings.ops import BUFFERS
from sparsecore.api import SparseCoreEmbedding
from sparsecore.preprocess import PartitionStats, RaggedIds, preprocess
from torchtpu import sharding

__all__ = ["SparseCoreBatch", "SparseCorePreprocessor"]


@dataclass(frozen=True)
class SparseCoreBatch:
    """One batch, ready for the lookup.

    `buffers[stack]`: the stack's inputs in `embeddings.ops.BUFFERS` order, `[devices, ...]`
    tensors sharded over the mesh. `lengths[key]` / `ids[key]`: each KJT key's lengths and ids
    (host), which unpooled outputs are shaped by. `sequence_rows[name]`: for each unpooled feature,
    the rows of its `[samples * max_seq_len]` activations that hold real ids (on `tpu`).
    `stats[stack]` are what the batch needed (see `sparsecore.preprocess.PartitionStats`);
    `dropped_ids` counts ids dropped by the limits (only with dropping allowed). `source` is the
    KJT it came from and `layout` the engine it was laid out for: a module whose layout changed
    since (batch size, grown limits) prepares `source` again. A batch with no `layout` holds only
    its `source` (`deferred`).
    """

    buffers: Mapping[str, tuple[torch.Tensor, ...]]
    lengths: Mapping[str, torch.Tensor]
    ids: Mapping[str, torch.Tensor]
    sequence_rows: Mapping[str, torch.Tensor]
    stats: Mapping[str, PartitionStats] = field(repr=False)
    dropped_ids: int = 0
    source: KeyedJaggedTensor | None = field(default=None, repr=False, compare=False)
    layout: SparseCoreEmbedding | None = field(default=None, repr=False, compare=False)

    @classmethod
    def deferred(cls, source: KeyedJaggedTensor) -> SparseCoreBatch:
        """A batch left for the module to prepare when it runs (e.g. one that needs its limits grown)."""
        return cls(buffers={}, lengths={}, ids={}, sequence_rows={}, stats={}, source=source)


class SparseCorePreprocessor:
    """Turns KJTs into `SparseCoreBatch`es for one module.

    `features` maps each KJT key to the features (embedding names) that read it; `batch_size` is
    this process's samples per batch; `sequence_lengths` gives the `max_seq_len` of unpooled
    features. With `weighted`, KJTs must carry per-id weights (TorchRec's `is_weighted`); without
    it weights are ignored, as TorchRec's unweighted modules do. Ids past a partition limit raise,
    unless `allow_id_dropping`, which drops and counts them (`dropped_ids`).
    """

    def __init__(
        self,
        engine: SparseCoreEmbedding,
        features: Mapping[str, tuple[str, ...]],
        batch_size: int,
        sequence_lengths: Mapping[str, int],
        weighted: bool = False,
        allow_id_dropping: bool = False,
        num_threads: int = 1,
    ) -> None:
        self.engine = engine
        self.features = dict(features)
        self.batch_size = batch_size
        self.sequence_lengths = dict(sequence_lengths)
        self.weighted = weighted
        self.allow_id_dropping = allow_id_dropping
        self.num_threads = num_threads
        self.dropped_ids = 0
        """Ids dropped over all batches so far (only with `allow_id_dropping`)."""
        self._stacks = tuple(engine.stacks.values())

    def __call__(self, kjt: KeyedJaggedTensor) -> SparseCoreBatch:
        ragged, lengths, ids = self._ragged_ids(kjt)
        packed = preprocess(
            self._stacks,
            ragged,
            self.engine.topology,
            allow_id_dropping=self.allow_id_dropping,
            with_unique_rows=True,
            num_threads=self.num_threads,
        )
        buffers = {
            stack: tuple(sharding.from_process_local(arrays[field]) for field in BUFFERS)
            for stack, arrays in self.engine.host_arrays(packed).items()
        }
        dropped = sum(batch.stats.id_drop_count for batch in packed.values())
        self.dropped_ids += dropped
        sequence_rows = {
            name: _sequence_rows(lengths[key], self.sequence_lengths[name])
            for key, names in self.features.items()
            for name in names
            if name in self.sequence_lengths
        }
        return SparseCoreBatch(
            buffers=buffers,
            lengths=lengths,
            ids=ids,
            sequence_rows=sequence_rows,
            stats={stack: batch.stats for stack, batch in packed.items()},
            dropped_ids=dropped,
            source=kjt,
            layout=self.engine,
        )

    def observe(self, kjt: KeyedJaggedTensor) -> dict[str, PartitionStats]:
        """What `kjt` needs of each stack, whatever the limits: every stack's observed maxima
        (`PartitionStats`), from a preprocessing that may drop and moves nothing to the device."""
        ragged, _, _ = self._ragged_ids(kjt)
        packed = preprocess(
            self._stacks,
            ragged,
            self.engine.topology,
            allow_id_dropping=True,
            with_unique_rows=False,
            num_threads=self.num_threads,
        )
        return {stack: batch.stats for stack, batch in packed.items()}

    def _ragged_ids(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[dict[str, RaggedIds], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every feature's ids on the host, after checking the KJT against the module."""
        keys = list(kjt.keys())
        missing = sorted(set(self.features) - set(keys))
        unexpected = sorted(set(keys) - set(self.features))
        if missing or unexpected:
            raise ValueError(
                f"KeyedJaggedTensor keys {keys} do not match this module's features: missing {missing}, "
                f"unexpected {unexpected}"
            )
        if kjt.variable_stride_per_key():
            raise ValueError("KeyedJaggedTensors with a variable batch size per key are not supported")
        if kjt.stride() != self.batch_size:
            raise ValueError(
                f"the KeyedJaggedTensor holds {kjt.stride()} samples, but the module was built for a batch of "
                f"{self.batch_size} per process (pad the last batch or drop it)"
            )
        weights = kjt.weights_or_none()
        if self.weighted and weights is None:
            raise ValueError("the module is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights")
        cpu = torch.device("cpu")
        values = kjt.values().detach().to(cpu)
        all_lengths = kjt.lengths().detach().to(cpu)
        weights = weights.detach().to(cpu) if self.weighted else None
        # The per-key totals from the lengths already on the host: `kjt.length_per_key()` would
        # sum them on the device, and reading that sum waits for all queued device work.
        per_key = kjt.length_per_key_or_none()
        if per_key is None:
            per_key = all_lengths.view(len(keys), self.batch_size).sum(1).tolist()
        offsets = np.cumsum([0, *per_key])
        ragged, lengths, ids = {}, {}, {}
        for index, key in enumerate(keys):
            start, stop = int(offsets[index]), int(offsets[index + 1])
            lengths[key] = all_lengths[index * self.batch_size : (index + 1) * self.batch_size]
            ids[key] = values[start:stop]
            feature_ids = RaggedIds(
                ids[key].numpy(),
                lengths=lengths[key].numpy(),
                weights=None if weights is None else weights[start:stop].numpy(),
            )
            for name in self.features[key]:
                ragged[name] = feature_ids
        return ragged, lengths, ids


def _sequence_rows(lengths: torch.Tensor, max_sequence_length: int) -> torch.Tensor:
    """Rows `sample * M + position` of every id, in input order, as a `tpu` index."""
    counts = lengths.numpy().astype(np.int64)
    starts = np.cumsum(counts) - counts
    positions = np.arange(counts.sum(), dtype=np.int64) - np.repeat(starts, counts)
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts) * max_sequence_length + positions
    return torch.from_numpy(rows).to("tpu")
