"""What the spawned stand-in hosts of the embedding tests run (see `_spawn.run_processes`).

Every process builds the same module (same seed: the initial tables are one global array) and
feeds its own samples of the same global batches; references train on the whole batches."""

from __future__ import annotations

import tempfile

import numpy as np
import torch
import torch.distributed as dist

import torchtpu
from _references import OPTIMIZERS, bag_tables, check_bag_training, kjt_keys, local_samples, random_kjt
from embeddings import SparseCoreEmbeddingBagCollection, join_process_mesh
from embeddings import checkpoint

STEPS = 10


def train_against_references(rank: int, world: int, batch_per_process: int, modes: tuple[str, ...]) -> None:
    """Forward and 10 training steps of every optimizer against its fused reference, as this
    process's rows of each global batch, the `modes` taken in turn (test_modules runs every
    optimizer in every mode on the default topology); then a sharded checkpoint round trip."""
    if world > 1:
        dist.init_process_group("gloo")
        join_process_mesh()
    tables = bag_tables()
    rows = slice(rank * batch_per_process, (rank + 1) * batch_per_process)
    for i, optimizer in enumerate(sorted(OPTIMIZERS)):
        mode = modes[i % len(modes)]
        ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=batch_per_process, optimizer=OPTIMIZERS[optimizer])
        run = torch.compile(ebc, backend="tpu") if mode == "compiled" else ebc
        with torchtpu.eager_mode("defer" if mode == "defer" else "strict"):
            check_bag_training(ebc, run, tables, optimizer, STEPS, batch_per_process * world, rows, seed=11)
    _checkpoint_round_trip(rank, world, tables, batch_per_process)
    if world > 1:
        dist.destroy_process_group()


def _checkpoint_round_trip(rank: int, world: int, tables, batch_per_process: int) -> None:
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=batch_per_process, optimizer=OPTIMIZERS["adagrad"])
    rng = np.random.default_rng(5)
    kjt = local_samples(random_kjt(rng, kjt_keys(tables), batch_per_process * world),
                        rank * batch_per_process, (rank + 1) * batch_per_process)
    (ebc(kjt).values() ** 2).sum().backward()
    path = _shared_tmp(rank) + "/checkpoint"
    checkpoint.save(checkpoint.sharded_state_dict(ebc), path)
    fresh = SparseCoreEmbeddingBagCollection(
        tables, batch_size=batch_per_process, optimizer=OPTIMIZERS["adagrad"], seed=9
    )
    state = checkpoint.sharded_state_dict(fresh)
    checkpoint.load(state, path)
    checkpoint.load_sharded_state_dict(fresh, state)
    for key, value in ebc.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    saved, loaded = ebc.fused_optimizer.state_dict()["state"], fresh.fused_optimizer.state_dict()["state"]
    for key, entries in saved.items():
        for name, value in entries.items():
            assert torch.equal(loaded[key][name], value), name


def _shared_tmp(rank: int) -> str:
    """A directory every process agrees on (rank 0's temporary directory)."""
    name = [tempfile.mkdtemp(prefix="embeddings-checkpoint-") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def write_checkpoint(rank: int, world: int, path: str, expected_path: str) -> None:
    """Train a little on this host's devices, save a sharded checkpoint at `path`, and the full
    tables and optimizer state (torch.save) at `expected_path` for the loading side to compare."""
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=32, optimizer=OPTIMIZERS["adam"])
    rng = np.random.default_rng(8)
    for _ in range(2):
        (ebc(random_kjt(rng, kjt_keys(tables), 32)).values() ** 2).sum().backward()
    checkpoint.save(checkpoint.sharded_state_dict(ebc), path)
    torch.save({"tables": ebc.state_dict(), "optimizer": ebc.fused_optimizer.state_dict()}, expected_path)


def interrupted_save(path: str, ready: str) -> None:
    """Save a new checkpoint at `path`, but stop dead once the data files are written (before the
    metadata): the test kills this process there."""
    import os
    import time

    import torch.distributed.checkpoint as dcp

    write_data = dcp.FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):
        future = write_data(self, plan, planner)
        future.wait()
        open(ready, "w").close()
        time.sleep(600)
        return future

    dcp.FileSystemWriter.write_data = write_then_hang
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=32, seed=4)
    checkpoint.save(checkpoint.sharded_state_dict(ebc), path)
    os._exit(1)  # not reached: the test kills the process in write_then_hang
