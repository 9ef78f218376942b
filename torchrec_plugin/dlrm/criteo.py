"""Real Criteo click logs from `--data-dir`, in TorchRec's formats, as the job's batch source.

Two layouts are read (TorchRec's, so its preprocessing scripts produce them):

* NPY: `day_<i>_dense.npy` (float32 `[rows, 13]`, already log-transformed), `day_<i>_sparse.npy`
  (`[rows, 26]` ids) and `day_<i>_labels.npy` (`[rows, 1]`), as written by
  `torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`;
* TSV: the raw logs (`day_<i>` / `*.tsv` / `*.txt`: label, 13 integer and 26 hexadecimal columns),
  read with TorchRec's `CriteoIterDataPipe` and transformed as `tsv_to_npys` does (missing values
  are 0; dense `log(x - min + 2)` with the file's minimum).

Sparse ids are hashed into each table (`id % rows`, TorchRec's `hashes`); every sample has one id
per feature. The last day's second half is held out (TorchRec's "test" split; with one day, its
second half); training batch `step` of rank `r` is rows `((step - 1) * world + r) * B` onwards of
the training rows, wrapping around at the end (an epoch), so any step can be read again.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, CriteoIterDataPipe
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_plugin.dlrm.config import DLRMConfig

__all__ = ["CriteoData", "read_tsv"]

_NPY = re.compile(r"day_(\d+)_dense\.npy")


class CriteoData:
    """Batches of this process's samples from the Criteo files in `directory`."""

    def __init__(self, directory: str | Path, config: DLRMConfig, rank: int = 0, world_size: int = 1) -> None:
        if config.num_sparse_features != CAT_FEATURE_COUNT or config.num_dense_features != INT_FEATURE_COUNT:
            raise ValueError(f"Criteo has {INT_FEATURE_COUNT} dense and {CAT_FEATURE_COUNT} sparse features; "
                             f"preset {config.name!r} has {config.num_dense_features} and {config.num_sparse_features}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        days = _read_days(Path(directory))
        last_dense, last_sparse, last_labels = days[-1]
        half = (len(last_labels) + 1) // 2
        held_out = (last_dense[half:], last_sparse[half:], last_labels[half:])
        days[-1] = (last_dense[:half], last_sparse[:half], last_labels[:half])
        train = tuple(np.concatenate(parts) for parts in zip(*days))
        hashes = np.asarray(config.num_embeddings, dtype=np.int64)
        self._train = (train[0], train[1] % hashes, train[2])
        self._held_out = (held_out[0], held_out[1] % hashes, held_out[2])
        global_batch = config.batch_size * world_size
        for name, (_, _, labels) in (("training", self._train), ("held-out", self._held_out)):
            if len(labels) < global_batch:
                raise ValueError(f"{directory}: the {name} split has {len(labels)} samples, fewer than one global "
                                 f"batch of {global_batch}")
        self._lengths = torch.ones(CAT_FEATURE_COUNT * config.batch_size, dtype=torch.int64)

    def train_batch(self, step: int) -> Batch:
        return self._batch(self._train, step - 1)

    def held_out_batch(self, index: int) -> Batch:
        return self._batch(self._held_out, index)

    def _batch(self, split: tuple[np.ndarray, np.ndarray, np.ndarray], index: int) -> Batch:
        dense, sparse, labels = split
        batch = self.config.batch_size
        start = (index * self.world_size + self.rank) * batch
        rows = np.arange(start, start + batch) % len(labels)
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(dense[rows], dtype=np.float32)),
            sparse_features=KeyedJaggedTensor(
                keys=list(self.config.feature_names),
                values=torch.from_numpy(np.ascontiguousarray(sparse[rows].T.reshape(-1), dtype=np.int64)),
                lengths=self._lengths,
            ),
            labels=torch.from_numpy(np.asarray(labels[rows]).reshape(-1).astype(np.int64)),
        )


def read_tsv(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One raw Criteo TSV file as (dense float32 `[rows, 13]`, sparse int64 `[rows, 26]`, labels
    int64 `[rows, 1]`), transformed as TorchRec's `tsv_to_npys` does."""

    def row(columns: list[str]) -> tuple[int, list[int], list[int]]:
        if len(columns) != 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT:
            raise ValueError(f"{path}: a Criteo row has {1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT} columns, "
                             f"got {len(columns)}")
        dense = [int(value or "0") for value in columns[1 : 1 + INT_FEATURE_COUNT]]
        sparse = [int(value or "0", 16) for value in columns[1 + INT_FEATURE_COUNT :]]
        return int(columns[0] or "0"), dense, sparse

    labels, dense, sparse = [], [], []
    for label, dense_row, sparse_row in CriteoIterDataPipe([str(path)], row_mapper=row):
        labels.append(label)
        dense.append(dense_row)
        sparse.append(sparse_row)
    if not labels:
        raise ValueError(f"{path}: no rows")
    counts = np.asarray(dense, dtype=np.int64)
    transformed = np.log(counts - counts.min() + 2, dtype=np.float32)
    return transformed, np.asarray(sparse, dtype=np.int64), np.asarray(labels, dtype=np.int64).reshape(-1, 1)


def _read_days(directory: Path) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    if not directory.is_dir():
        raise FileNotFoundError(f"--data-dir {directory} is not a directory")
    npy = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NPY.fullmatch(p.name)))
    if npy:
        return [
            tuple(np.load(directory / f"day_{day}_{part}.npy", mmap_mode="r") for part in ("dense", "sparse", "labels"))
            for day, _ in npy
        ]
    tsv = sorted(p for p in directory.iterdir()
                 if p.is_file() and (re.fullmatch(r"day_\d+", p.name) or p.suffix in (".tsv", ".txt")))
    if not tsv:
        raise FileNotFoundError(
            f"{directory}: no Criteo files (day_<i>_dense/sparse/labels.npy, day_<i>, *.tsv, *.txt)"
        )
    return [read_tsv(path) for path in tsv]
