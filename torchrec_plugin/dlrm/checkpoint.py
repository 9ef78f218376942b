"""Checkpoints of the training job with `torch.distributed.checkpoint`, atomic and sharded.

One checkpoint holds the whole training state at a step boundary, in TorchRec's form:

* `model`: the sharded model's `state_dict()`: every table a ShardedTensor whose shards each
  process writes (DCP records them as chunks of the whole table, so another process count can
  read them), the dense layers replicated (written once);
* `optim`: `tables`, the fused optimizer's `state_dict()` (the tables' Adagrad state, sharded as
  the tables are, `torchrec_plugin.fused_optimizer`), and `dense`, the dense Adagrad's
  (`<parameter>.sum`, `<parameter>.step`);
* `progress`: the step. The synthetic stream is reproducible by step, so no data state is needed.

`save` goes through `embeddings.checkpoint.save`: the new version is written beside the old one
and `<dir>/checkpoint` (a symlink) is switched to it only once every process has written, so a
crash during a save leaves the previous checkpoint usable. DCP coordinates over the gloo group
beside the default group (`torchrec_plugin.groups`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from embeddings import checkpoint as atomic
from torchrec_plugin.dlrm.model import DLRMTraining
from torchrec_plugin.groups import host_group

__all__ = ["LINK_NAME", "restore", "save"]

LINK_NAME = "checkpoint"


def save(training: DLRMTraining, step: int, directory: str | Path) -> None:
    """Write `training`'s state after `step` to `directory` (every process calls it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic.save(_state(training, step, copy_values=True), directory / LINK_NAME, process_group=host_group())


def restore(training: DLRMTraining, directory: str | Path | None) -> int:
    """Load the checkpoint in `directory` into `training`; returns its step."""
    path = Path(directory) / LINK_NAME if directory is not None else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            f"--resume: no checkpoint at {path} (it is written by a run with a checkpoint directory)"
        )
    state = _state(training, step=0, copy_values=False)
    atomic.load(state, path, process_group=host_group())
    training.model.load_state_dict(state["model"])
    training.model.fused_optimizer.load_state_dict(state["optim"]["tables"])
    optimizer_state = training.dense_optimizer.state
    with torch.no_grad():
        for name, parameter in training.dense_parameters().items():
            for slot, value in optimizer_state[parameter].items():
                value.copy_(state["optim"]["dense"][f"{name}.{slot}"])
    return int(state["progress"]["step"])


def _state(training: DLRMTraining, step: int, copy_values: bool) -> dict[str, Any]:
    """The DCP state: the model's and the fused optimizer's state dicts (their current values,
    which a load overwrites), and host tensors of the dense optimizer's state (its current values
    to save, or empty ones of the right shape to load into)."""

    def host(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().cpu() if copy_values else torch.empty(tensor.shape, dtype=tensor.dtype)

    optimizer_state = training.dense_optimizer.state
    dense = {
        f"{name}.{slot}": host(value)
        for name, parameter in training.dense_parameters().items()
        for slot, value in optimizer_state[parameter].items()
    }
    return {
        "model": training.model.state_dict(),
        "optim": {"tables": training.model.fused_optimizer.state_dict(), "dense": dense},
        "progress": {"step": torch.tensor(step, dtype=torch.int64)},
    }
