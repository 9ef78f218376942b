"""tpu_dist under the real launcher: `torchrun --nproc-per-node 2`, one process per device."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import stand_in

pytestmark = pytest.mark.slow


def test_torchrun_with_tpu_dist_and_mixed_backends():
    script = Path(__file__).with_name("_torchrun_script.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    with tempfile.TemporaryDirectory(prefix="tpu-dist-torchrun-") as lock_dir:
        env = dict(os.environ, TORCHTPU_LOCK_DIR=lock_dir, TORCHTPU_NUM_DEVICES="2",
                   XLA_FLAGS=stand_in.xla_flags(2))
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 of 2: ok" in done.stdout and "rank 1 of 2: ok" in done.stdout, done.stdout
