"""TorchRec's own models -- `DLRM`, `DLRM_DCN` and `SimpleDeepFMNN` -- train on `tpu` under
`DistributedModelParallel` with the plan the plugin's planner makes for a TPU topology, on
TorchRec's `RandomRecDataset`: two ranks, each a spawned stand-in host driving one device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "embeddings"))

import _model_workers  # noqa: E402
from _spawn import run_processes  # noqa: E402


@pytest.mark.slow
def test_torchrec_models_train_under_dmp_with_the_planners_plan(tmp_path):
    out = tmp_path / "results.json"
    run_processes(_model_workers.train_models, 2, 1, "v5p", str(out), timeout=900)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(_model_workers.MODELS)
    for name, result in results.items():
        losses = np.asarray(result["losses"])
        assert len(losses) == _model_workers.STEPS and np.isfinite(losses).all(), name
        first, last = losses[:4].mean(), losses[-4:].mean()
        assert last < 0.9 * first, f"{name}: the loss did not fall ({first:.4f} -> {last:.4f}): {losses}"
        assert set(result["sharding"]) == {f"t_{key}" for key in _model_workers.KEYS}, name
