"""The Criteo reader against TorchRec's own: raw TSV rows transformed as TorchRec's `tsv_to_npys`,
and batches equal to those of TorchRec's `InMemoryBinaryCriteoIterDataPipe` (its "val" split is
the job's training rows, its "test" split the held-out ones), from NPY or TSV files alike."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe

from torchrec_plugin.dlrm.config import preset
from torchrec_plugin.dlrm.criteo import CriteoData, read_tsv

DAY = Path(__file__).parent / "data" / "day_0"
CONFIG = preset("tiny").with_batch_size(16)


@pytest.fixture(scope="module")
def npy_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("npy")
    outputs = (str(directory / f"day_0_{part}.npy") for part in ("dense", "sparse", "labels"))
    BinaryCriteoUtils.tsv_to_npys(str(DAY), *outputs)
    return directory


def test_tsv_rows_as_torchrec_converts_them(npy_dir):
    dense, sparse, labels = read_tsv(DAY)
    np.testing.assert_array_equal(dense, np.load(npy_dir / "day_0_dense.npy"))
    np.testing.assert_array_equal(sparse, np.load(npy_dir / "day_0_sparse.npy"))
    np.testing.assert_array_equal(labels, np.load(npy_dir / "day_0_labels.npy"))


@pytest.mark.parametrize("layout", ["npy", "tsv"])
def test_batches_match_torchrec(npy_dir, tmp_path, layout):
    if layout == "tsv":
        shutil.copy(DAY, tmp_path / "day_0")
    data = CriteoData(npy_dir if layout == "npy" else tmp_path, CONFIG)
    for stage, ours in (("val", data.train_batch(1)), ("test", data.held_out_batch(0))):
        paths = {f"{part}_paths": [str(npy_dir / f"day_0_{part}.npy")] for part in ("dense", "sparse", "labels")}
        theirs = next(iter(InMemoryBinaryCriteoIterDataPipe(
            stage=stage, batch_size=CONFIG.batch_size, rank=0, world_size=1, hashes=list(CONFIG.num_embeddings),
            **paths,
        )))
        torch.testing.assert_close(ours.dense_features, theirs.dense_features, rtol=0, atol=0)
        torch.testing.assert_close(ours.labels, theirs.labels.to(torch.int64), rtol=0, atol=0)
        for key in CONFIG.feature_names:
            expected = theirs.sparse_features[key]
            assert torch.equal(ours.sparse_features[key].values(), expected.values().to(torch.int64)), key
            assert torch.equal(ours.sparse_features[key].lengths(), expected.lengths().to(torch.int64)), key


def test_too_few_rows_is_an_error(npy_dir):
    with pytest.raises(ValueError, match="fewer than one global batch of 64"):
        CriteoData(npy_dir, CONFIG, world_size=4)
