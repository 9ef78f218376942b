"""The DLRM-DCN training job on `tpu` (tables sharded by the plugin's planner under DMP), tiny
preset: over 200 steps it learns the synthetic teacher (held-out AUC), a model built from other
weights and resumed from the checkpoint the run wrote half way reproduces the second half of its
loss curve exactly, a save that dies leaves the previous checkpoint usable (model,
fused and dense optimizer state restored bit for bit), and its first 20 losses match plain
TorchRec on CPU.

The jobs run in a fresh process with one stand-in device (`_jobs.py`), as each process of the
job drives one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stand_in

STEPS = 200

pytestmark = pytest.mark.slow  # each test trains in a process of its own for about two minutes


def _run_job(tmp_path: Path, function: str, *args) -> dict:
    out = tmp_path / f"{function}.json"
    call = f"import _jobs; _jobs.{function}({str(out)!r}, {', '.join(map(repr, args))})"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[3]),
        "TORCHTPU_NUM_DEVICES": "1",
        "XLA_FLAGS": stand_in.xla_flags(1),
        "TORCHTPU_LOCK_DIR": str(tmp_path / "locks"),
        "TORCHTPU_STRICT_OPS": "1",  # every op on the device: one without a tpu kernel fails the job
    }
    subprocess.run([sys.executable, "-c", call], cwd=Path(__file__).parent, env=env, check=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["defer"])
def test_learns_and_resumes_exactly(tmp_path, mode):
    result = _run_job(tmp_path, "learn_and_resume", str(tmp_path / "checkpoints"), STEPS, mode)
    uninterrupted = result["uninterrupted"]
    assert len(uninterrupted) == STEPS
    assert result["auc"][-1] > 0.7, result["auc"]
    half = STEPS // 2
    assert result["second_start"] == half
    assert result["second"] == uninterrupted[half:]
    assert result["second_auc"][-1] == result["auc"][-1]
    assert result["failed_save"] == {"raised": True, "step": STEPS, "state_keys_equal": True, "state_equal": True}


def test_under_autocast_the_first_losses_match_torchrec_under_cpu_autocast(tmp_path):
    """`TrainOptions(autocast=True)`: the same 20 steps with each forward under its device's
    autocast (bfloat16 linears on both) stay close to TorchRec on CPU: 3.8e-3 apart at most,
    where the job under autocast and CPU without it are 1.1e-2 apart (and both in float32 2e-6)."""
    result = _run_job(tmp_path, "cpu_parity", 20, "defer", True)
    np.testing.assert_allclose(result["tpu"], result["cpu"], rtol=0, atol=6e-3)
    assert result["cpu"][-1] < result["cpu"][0]


@pytest.mark.parametrize("mode", ["strict", "compiled"])
def test_first_losses_match_torchrec_on_cpu(tmp_path, mode):
    """Same seed, same batches: plain TorchRec on CPU (its EmbeddingBagCollection with torch's
    Adagrad in the backward, torch's Adagrad for the dense layers) and the job on tpu at the
    `highest` matmul precision give losses within 1e-4 for 20 steps, eager and compiled."""
    result = _run_job(tmp_path, "cpu_parity", 20, mode)
    np.testing.assert_allclose(result["tpu"], result["cpu"], rtol=0, atol=1e-4)
    assert result["cpu"][-1] < result["cpu"][0]
