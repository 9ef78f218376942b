"""Sharded checkpoints with torch.distributed.checkpoint: save -> load on the same topology is
bit-exact and training resumes identically; reloading onto another SparseCore or device count;
a plain TorchRec CPU module loads the tables for inference; an interrupted save leaves the
previous checkpoint intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import _workers
from _references import OPTIMIZERS, bag_tables, kjt_keys, random_kjt
from _spawn import run_processes
from embeddings import SparseCoreEmbeddingBagCollection, checkpoint
from sparsecore.topology import Topology

BATCH = 32


def _train(ebc, seed: int, steps: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        kjt = random_kjt(rng, kjt_keys(bag_tables()), BATCH)
        grad = torch.from_numpy(rng.standard_normal((BATCH, 48)).astype(np.float32))
        (ebc(kjt).values() * grad.to("tpu")).sum().backward()


def _state(ebc) -> dict[str, torch.Tensor]:
    """Tables and optimizer state, flat."""
    out = dict(ebc.state_dict())
    for key, entries in ebc.fused_optimizer.state_dict()["state"].items():
        out.update({f"{key}/{name}": value for name, value in entries.items()})
    return out


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _restore(ebc, path) -> None:
    state = checkpoint.sharded_state_dict(ebc)
    checkpoint.load(state, path)
    checkpoint.load_sharded_state_dict(ebc, state)


def test_same_topology_is_bit_exact_and_training_resumes(tmp_path):
    ebc = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["adam"])
    _train(ebc, seed=0, steps=2)
    saved = _state(ebc)
    checkpoint.save(checkpoint.sharded_state_dict(ebc), tmp_path / "ckpt")
    _train(ebc, seed=1, steps=3)
    resumed = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["adam"], seed=7)
    _restore(resumed, tmp_path / "ckpt")
    _assert_same(_state(resumed), saved)
    _train(resumed, seed=1, steps=3)
    _assert_same(_state(resumed), _state(ebc))


def test_reload_onto_another_sparsecore_count(tmp_path):
    eight = Topology.cpu(4, sparsecores_per_device=2)
    ebc = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["rowwise_adagrad"],
                                           topology=eight, stacking="none")
    _train(ebc, seed=2, steps=2)
    checkpoint.save(checkpoint.sharded_state_dict(ebc), tmp_path / "ckpt")
    sixteen = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["rowwise_adagrad"])
    _restore(sixteen, tmp_path / "ckpt")
    _assert_same(_state(sixteen), _state(ebc))
    kjt = random_kjt(np.random.default_rng(3), kjt_keys(bag_tables()), BATCH)
    torch.testing.assert_close(sixteen(kjt).values().cpu(), ebc(kjt).values().cpu(), rtol=0, atol=1e-6)


def test_torchrec_cpu_module_loads_the_checkpoint_for_inference(tmp_path):
    ebc = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["adagrad"])
    _train(ebc, seed=4, steps=2)
    checkpoint.save(checkpoint.sharded_state_dict(ebc), tmp_path / "ckpt")
    reference = EmbeddingBagCollection(bag_tables())
    state = {"model": reference.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    reference.load_state_dict(state["model"])
    kjt = random_kjt(np.random.default_rng(5), kjt_keys(bag_tables()), BATCH)
    torch.testing.assert_close(ebc(kjt).values().cpu(), reference(kjt).values().detach(), rtol=0, atol=1e-6)


def test_save_replaces_only_its_own_checkpoints(tmp_path):
    (tmp_path / "plain").mkdir()
    ebc = SparseCoreEmbeddingBagCollection(bag_tables()[:1], batch_size=BATCH)
    with pytest.raises(ValueError, match="is not a checkpoint written by embeddings.checkpoint.save"):
        checkpoint.save(checkpoint.sharded_state_dict(ebc), tmp_path / "plain")
    checkpoint.save(checkpoint.sharded_state_dict(ebc), tmp_path / "ckpt")
    first = (tmp_path / "ckpt").resolve()
    checkpoint.save(checkpoint.sharded_state_dict(ebc), tmp_path / "ckpt")
    assert (tmp_path / "ckpt").resolve() != first and not first.exists()
    versions = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]
    assert versions == [(tmp_path / "ckpt").resolve().name]


@pytest.mark.slow
def test_killed_save_leaves_the_previous_checkpoint(tmp_path):
    ebc = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["sgd"])
    _train(ebc, seed=6, steps=1)
    checkpoint.save(checkpoint.sharded_state_dict(ebc), tmp_path / "ckpt")
    saved, version = _state(ebc), (tmp_path / "ckpt").resolve()
    ready = tmp_path / "ready"
    code = f"import _workers; _workers.interrupted_save({str(tmp_path / 'ckpt')!r}, {str(ready)!r})"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "TORCHTPU_LOCK_DIR": str(tmp_path / "locks")}
    child = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert child.poll() is None, "the saving process died before writing its data"
            assert time.monotonic() < deadline, "the saving process never wrote its data"
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.") and p != version]
    assert partial and not (partial[0] / ".metadata").exists()
    assert (tmp_path / "ckpt").resolve() == version
    restored = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["sgd"], seed=8)
    _restore(restored, tmp_path / "ckpt")
    _assert_same(_state(restored), saved)


@pytest.mark.slow
def test_two_devices_to_four(tmp_path):
    run_processes(_workers.write_checkpoint, 1, 2, str(tmp_path / "ckpt"), str(tmp_path / "expected.pt"))
    expected = torch.load(tmp_path / "expected.pt")
    four = SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, optimizer=OPTIMIZERS["adam"])
    _restore(four, tmp_path / "ckpt")
    _assert_same(dict(four.state_dict()), dict(expected["tables"]))
    for key, entries in expected["optimizer"]["state"].items():
        for name, value in entries.items():
            assert torch.equal(four.fused_optimizer.state_dict()["state"][key][name], value), name
