"""`torchtpu-train-dlrm`: option errors name the problem; presets are checked; two processes
train end to end with either sharding (slow: spawned processes)."""

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
        (["--sharding", "planner", "--checkpoint-dir", "x"], "--checkpoint-dir needs --sharding direct"),
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


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["direct", "planner"])
def test_two_processes_train(tmp_path, sharding):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3]), "TORCHTPU_LOCK_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "torchrec_plugin.dlrm.cli", "--size", "tiny", "--steps", "60", "--nproc", "2",
               "--sharding", sharding, "--no-progress"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es) x batch 128: steps 1-60" in done.stdout
    auc = float(re.search(r"held-out at step 60: AUC (\d\.\d+)", done.stdout).group(1))
    assert auc > 0.7, done.stdout
