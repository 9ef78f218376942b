"""What the DLRM job tests run in a fresh process with ONE stand-in device (see
`test_train._run_job`): the job as one process of torch.distributed (`launch.run`), as the CLI
runs it.

Each function writes what the test checks as JSON to `out`."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_plugin.dlrm import checkpoint, launch
from torchrec_plugin.dlrm.config import preset
from torchrec_plugin.dlrm.model import DLRMTraining, build, reference
from torchrec_plugin.dlrm.synthetic import SyntheticCriteo
from torchrec_plugin.dlrm.train import TrainOptions, train

TINY = preset("tiny")


def _options(steps: int, mode: str, **kwargs) -> TrainOptions:
    return TrainOptions(steps=steps, mode=mode, eval_batches=4, progress=False, **kwargs)


def learn_and_resume(out: str, directory: str, steps: int, mode: str) -> None:
    launch.run(_learn_and_resume, out, directory, steps, mode)


def _learn_and_resume(out: str, directory: str, steps: int, mode: str) -> None:
    """An uninterrupted run that checkpoints half way; a model built from other weights resumed
    from that checkpoint runs the second half; then a save that dies midway."""
    source = SyntheticCriteo(TINY, seed=0)
    half = steps // 2
    kept = f"{directory}-half"
    with _keeping_checkpoint_of(half, kept):
        uninterrupted = train(build(TINY), source, _options(steps, mode, checkpoint_dir=directory,
                                                            checkpoint_every=half))
    resumed = build(TINY, seed=1)
    second = train(resumed, source, _options(steps, mode, checkpoint_dir=kept, resume=True))
    result = {
        "uninterrupted": uninterrupted.losses,
        "auc": [e.auc for e in uninterrupted.evaluations],
        "second": second.losses,
        "second_start": second.start_step,
        "second_auc": [e.auc for e in second.evaluations],
        "failed_save": _failed_save_keeps_previous(resumed, directory, steps),
    }
    with open(out, "w") as f:
        json.dump(result, f)


@contextlib.contextmanager
def _keeping_checkpoint_of(step: int, kept: str) -> Iterator[None]:
    """Copy the checkpoint written after `step` to the directory `kept`, laid out as the job lays
    it out (a version directory and the link to it): the job keeps only its newest checkpoint."""
    save = checkpoint.save

    def save_and_keep(training: DLRMTraining, saved_step: int, directory) -> None:
        save(training, saved_step, directory)
        if saved_step == step:
            version = (Path(directory) / checkpoint.LINK_NAME).resolve()
            shutil.copytree(version, Path(kept) / version.name)
            (Path(kept) / checkpoint.LINK_NAME).symlink_to(version.name)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "save", save_and_keep)
        yield


def _failed_save_keeps_previous(trained: DLRMTraining, directory: str, step: int) -> dict:
    """Save again, dying after the data is written (before the metadata): what the checkpoint
    then restores into a model built from other weights."""
    write_data = dcp.FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        write_data(self, plan, planner).wait()
        raise OSError("disk gone during the save")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dcp.FileSystemWriter, "write_data", write_then_fail)
        try:
            checkpoint.save(trained, step + 1, directory)
            raised = False
        except CheckpointException as error:  # DCP reports each rank's exception
            raised = "disk gone" in str(error)
    restored = build(TINY, seed=2)
    restored_step = checkpoint.restore(restored, directory)
    expected, got = _state(trained), _state(restored)
    return {
        "raised": raised,
        "step": restored_step,
        "state_keys_equal": sorted(got) == sorted(expected),
        "state_equal": all(torch.equal(got[key], value) for key, value in expected.items()),
    }


def _state(training: DLRMTraining) -> dict[str, torch.Tensor]:
    """Everything a checkpoint restores, on the host: the model's state dict (each table's local
    shards), the fused optimizer's (the tables' Adagrad state) and the dense Adagrad's."""
    out = {}
    for key, value in training.model.state_dict().items():
        out.update(_local(key, value))
    for key, entries in training.model.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            out.update(_local(f"{key}/{name}", value))
    for name, parameter in training.dense_parameters().items():
        for slot, value in training.dense_optimizer.state[parameter].items():
            out[f"{name}/{slot}"] = value.detach().cpu()
    return out


def _local(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    if not isinstance(value, ShardedTensor):
        return {key: value.detach().cpu()}
    return {f"{key}@{shard.metadata.shard_offsets}": shard.tensor.detach().cpu() for shard in value.local_shards()}


def cpu_parity(out: str, steps: int, mode: str, autocast: bool = False) -> None:
    launch.run(_cpu_parity, out, steps, mode, autocast)


def _cpu_parity(out: str, steps: int, mode: str, autocast: bool) -> None:
    """Losses of the job on tpu at the `highest` precision and of plain TorchRec on CPU, from the
    same seed on the same batches; with `autocast`, each forward under its device's autocast."""
    source = SyntheticCriteo(TINY, seed=3)
    training = build(TINY, seed=3)
    cpu_model, cpu_optimizer = reference(TINY, seed=3)
    summary = train(training, source, _options(steps, mode, precision="highest", autocast=autocast))
    expected = []
    for step in range(1, steps + 1):
        batch = source.train_batch(step)
        with torch.autocast("cpu", enabled=autocast):
            logits = cpu_model(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        cpu_optimizer.zero_grad()
        loss.backward()
        cpu_optimizer.step()
        expected.append(float(loss))
    with open(out, "w") as f:
        json.dump({"tpu": summary.losses, "cpu": expected}, f)
