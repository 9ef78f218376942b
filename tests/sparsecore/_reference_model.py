"""A slow, loop-per-id model of SparseCore host preprocessing, written from the golden README.

It shares no code with `sparsecore.preprocess`: plain Python loops over samples and ids,
float32 scalars for the gains, dicts for merging. Tests compare the vectorised implementation
against it on random inputs, and check it against the golden data too, so a shared misreading of
the spec would show up there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD = 2**31 - 1


def _round8(x: int) -> int:
    return (x + 7) // 8 * 8


def sample_gains(combiner: str, weights: list[np.float32]) -> list[np.float32]:
    """Gains of one sample's ids: w / 1, w / sum(w) or w / sqrt(sum(w^2)), float32, in order."""
    if combiner == "sum":
        return list(weights)
    acc = np.float32(0.0)
    for w in weights:
        if combiner == "mean":
            acc = np.float32(acc + w)
        else:
            acc = np.float32(np.float64(acc) + np.float64(w) * np.float64(w))
    divisor = acc if combiner == "mean" else np.sqrt(acc)
    return [np.float32(w / divisor) for w in weights]


def ids_with_gains(stack, inputs):
    """Every id of the stack's features in input order, as (feature placement, host-local
    output row, id, float32 gain). `inputs[name]` = (per-sample id lists, per-sample weight
    lists or None)."""
    for fp in stack.features:
        ids, weights = inputs[fp.feature.name]
        seq = fp.feature.max_sequence_length
        for b, sample in enumerate(ids):
            if weights is None:
                w = [np.float32(1.0)] * len(sample)
            else:
                w = [np.float32(x) for x in weights[b]]
            gains = w if seq else sample_gains(stack.combiner.value, w)
            for pos, (e, gain) in enumerate(zip(sample, gains)):
                yield fp, (b * seq + pos if seq else b), int(e), gain


@dataclass
class ModelOutput:
    row_pointers: np.ndarray
    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray
    max_ids: np.ndarray
    max_unique: np.ndarray
    required: np.ndarray
    dropped: int
    entries: dict


def preprocess_model(
    stack, inputs, topology, allow_id_dropping: bool, coo_size: int
) -> ModelOutput:
    """Expected buffers of one stack. `inputs[name]` = (list of per-sample id lists, list of
    per-sample weight lists or None)."""
    g, l, s_per = (
        topology.global_device_count,
        topology.local_device_count,
        topology.sparsecores_per_device,
    )
    n = g * s_per
    # entries[(d, s)][(p, emb, sample)] = [gain, raw count]
    entries: dict = {(d, s): {} for d in range(l) for s in range(s_per)}
    for fp, row, e, gain in ids_with_gains(stack, inputs):
        table = stack.tables[fp.table_index]
        local_sc, j = divmod(row, fp.samples_per_sparsecore)
        d, s = divmod(local_sc, s_per)
        key = (
            (e + table.shard_rotation) % n,
            e // n + table.row_offset_in_shard,
            fp.sample_offset_in_sparsecore + j,
        )
        slot = entries[(d, s)].setdefault(key, [np.float32(0.0), 0])
        slot[0] = np.float32(slot[0] + gain)
        slot[1] += 1
    r = max(n, 8)
    seg = coo_size // s_per
    rp = np.zeros((l, s_per * r), np.int32)
    emb_buf = np.full((l, coo_size), PAD, np.int32)
    smp_buf = np.full((l, coo_size), PAD, np.int32)
    gain_buf = np.full((l, coo_size), np.nan, np.float32)
    max_ids = np.zeros((l, n), np.int64)
    max_unique = np.zeros((l, n), np.int64)
    required = np.zeros((l, s_per), np.int64)
    dropped = 0
    for (d, s), sc_entries in entries.items():
        pos = 0
        for p in range(n):
            pairs = sorted((k, v) for k, v in sc_entries.items() if k[0] == p)
            columns = sorted({k[1] for k, _ in pairs})
            max_ids[d, p] = max(max_ids[d, p], len(pairs))
            max_unique[d, p] = max(max_unique[d, p], len(columns))
            required[d, s] += _round8(len(pairs))
            start = _round8(pos)
            pos = start
            for k, (key, (gain, count)) in enumerate(pairs, start=1):
                rank = columns.index(key[1]) + 1
                limited = (
                    k > stack.max_ids_per_partition or rank > stack.max_unique_ids_per_partition
                )
                if allow_id_dropping and limited or pos >= seg:
                    dropped += count
                    continue
                emb_buf[d, s * seg + pos] = key[1]
                smp_buf[d, s * seg + pos] = key[2]
                gain_buf[d, s * seg + pos] = gain
                pos += 1
            rp[d, s * r + p] = pos
        rp[d, s * r + n : (s + 1) * r] = _round8(pos)
    return ModelOutput(
        rp, emb_buf, smp_buf, gain_buf, max_ids, max_unique, required, dropped, entries
    )
