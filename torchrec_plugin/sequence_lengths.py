"""`max_seq_len`: the longest sequence a sample may carry in a feature of an EmbeddingCollection.

SparseCore looks a sequence feature up as a static `[samples, max_seq_len]` block, so each FUSED
table of an `EmbeddingCollection` needs this bound. Deriving it from the batches would change the
layout, and recompile the programs, whenever a longer sample came; so it is a setting of the
sharder (`EmbeddingCollectionSharder(max_seq_len=...)`, one length for every table or one per
table), which the planner's estimators read for the static buffers and which reaches the kernels
in each table's `fused_params` under `MAX_SEQ_LEN`. A longer sample is an error, never cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["MAX_SEQ_LEN", "sequence_lengths"]

MAX_SEQ_LEN = "max_seq_len"
"""The `fused_params` key of the setting (on a table: an int; on a sharder: an int or a mapping)."""


def sequence_lengths(setting: int | Mapping[str, int] | None, tables: Iterable[str]) -> dict[str, int]:
    """Each of `tables`' `max_seq_len` from a sharder's setting: one length for every table, or
    a mapping from table name to length. Raises naming the tables the setting leaves without one."""
    tables = list(tables)
    if setting is None:
        lengths: dict[str, int] = {}
    elif isinstance(setting, Mapping):
        lengths = {name: setting[name] for name in tables if name in setting}
    else:
        lengths = dict.fromkeys(tables, setting)
    missing = [name for name in tables if name not in lengths]
    if missing:
        raise ValueError(
            f"tables {missing}: a SparseCore sequence lookup needs max_seq_len, the most ids one sample may carry "
            "(its buffers have static shapes); pass EmbeddingCollectionSharder(max_seq_len=...) or "
            "torchrec_plugin.sharders(max_seq_len=...), one int or {table: int}"
        )
    wrong = {name: value for name, value in lengths.items() if not isinstance(value, int) or value <= 0}
    if wrong:
        raise ValueError(f"max_seq_len must be a positive int, got {wrong}")
    return lengths
