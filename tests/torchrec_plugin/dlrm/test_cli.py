"""`torchtpu-train-dlrm`: option errors name the problem; presets are checked; two processes
train end to end and checkpoint (slow: spawned processes)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_plugin.dlrm.cli import parse_args
from torchrec_plugin.dlrm.config import preset


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--size", "huge"], "invalid choice: 'huge'"),
    ],
)
def test_option_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_preset_errors():
    tiny = preset("tiny")
    with pytest.raises(ValueError, match="26 tables but 3 multi-hot sizes"):
        dataclasses.replace(tiny, multi_hot_sizes=(1, 2, 3))
    with pytest.raises(ValueError, match="must end at the embedding dimension 8"):
        dataclasses.replace(tiny, dense_arch_layer_sizes=(32, 16))
    with pytest.raises(ValueError, match=r"rows and ids per sample >= 1, got \{'cat_0': \(0, 1\)\}"):
        dataclasses.replace(tiny, num_embeddings=(0, *tiny.num_embeddings[1:]))


def _train(tmp_path: Path, *args: str, **env_vars: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3]), "TORCHTPU_LOCK_DIR": str(tmp_path / "locks"),
           **env_vars}
    command = [sys.executable, "-m", "torchrec_plugin.dlrm.cli", "--size", "tiny", "--nproc", "2", "--no-progress",
               "--checkpoint-dir", str(tmp_path / "checkpoints"), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_two_processes_train_and_checkpoint(tmp_path):
    """The CLI as a user runs it: two processes train, each writes its shards of the tables and
    of their optimizer state, and the held-out AUC shows learning. (Resuming from such a
    checkpoint is test_train's and test_dmp's: bit-exact, and onto another world size.)"""
    out = _train(tmp_path, "--steps", "70", "--checkpoint-every", "35", "--eval-every", "70", "--eval-batches", "4")
    assert "2 process(es) x batch 128: steps 1-70" in out
    assert "checkpoints written: 2" in out
    auc = float(re.search(r"held-out at step 70: AUC (\d\.\d+)", out).group(1))
    assert auc > 0.7, out
    assert (tmp_path / "checkpoints" / "checkpoint" / ".metadata").is_file()


@pytest.mark.slow
def test_two_processes_train_compiled_with_every_op_on_the_device(tmp_path):
    """`--mode compiled` across two processes, with `TORCHTPU_STRICT_OPS=1` so that any op
    without a tpu kernel fails the run: under torch.compile TorchRec permutes the KJTs it
    distributes with FBGEMM's `permute_2D_sparse_data_input1D`, which took the CPU fallback."""
    out = _train(tmp_path, "--mode", "compiled", "--steps", "30", "--eval-every", "30", "--eval-batches", "2",
                 TORCHTPU_STRICT_OPS="1")
    assert "compiled mode, 2 process(es) x batch 128: steps 1-30" in out
    first, last = map(float, re.search(r"loss: first (\d\.\d+), last (\d\.\d+)", out).groups())
    assert last < first, out
