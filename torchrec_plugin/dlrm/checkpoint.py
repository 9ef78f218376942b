"""Checkpoints of the training job with `torch.distributed.checkpoint`, atomic and sharded.

One checkpoint holds the whole training state at a step boundary:

* `model`: the dense layers (replicated: DCP writes them once) and every table, each process
  writing only its own rows (`embeddings.checkpoint.RowBlocks`), under `DLRM_DCN`'s names;
* `optim`: the tables' fused Adagrad state (TorchRec's names) and the dense Adagrad's
  (`<parameter>.sum`, `<parameter>.step`);
* `progress`: the step. The synthetic stream is reproducible by step, so no data state is needed.

`save` goes through `embeddings.checkpoint.save`: the new version is written beside the old one
and `<dir>/checkpoint` (a symlink) is switched to it only once every process has written, so a
crash during a save leaves the previous checkpoint usable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from embeddings import checkpoint as sharded
from torchrec_plugin.dlrm.model import SPARSE_PREFIX, DLRMTraining

__all__ = ["LINK_NAME", "restore", "save"]

LINK_NAME = "checkpoint"


def save(training: DLRMTraining, step: int, directory: str | Path) -> None:
    """Write `training`'s state after `step` to `directory` (every process calls it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sharded.save(_state(training, step, copy_values=True), directory / LINK_NAME)


def restore(training: DLRMTraining, directory: str | Path | None) -> int:
    """Load the checkpoint in `directory` into `training`; returns its step."""
    path = Path(directory) / LINK_NAME if directory is not None else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            f"--resume: no checkpoint at {path} (it is written by a run with a checkpoint directory)"
        )
    state = _state(training, step=0, copy_values=False)
    sharded.load(state, path)
    sharded.load_sharded_state_dict(training.tables, state, prefix=SPARSE_PREFIX)
    parameters = training.dense_parameters()
    optimizer_state = training.dense_optimizer.state
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(state["model"][name])
            slots = optimizer_state[parameter]
            for slot, value in slots.items():
                value.copy_(state["optim"]["dense"][f"{name}.{slot}"])
    return int(state["progress"]["step"])


def _state(training: DLRMTraining, step: int, copy_values: bool) -> dict[str, Any]:
    """The DCP state: this process's table rows, and host tensors of the dense state (their
    current values to save, or empty ones of the right shape to load into)."""

    def host(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().cpu() if copy_values else torch.empty(tensor.shape, dtype=tensor.dtype)

    state = sharded.sharded_state_dict(training.tables, prefix=SPARSE_PREFIX)
    optimizer_state = training.dense_optimizer.state
    dense_optim = {}
    for name, parameter in training.dense_parameters().items():
        state["model"][name] = host(parameter)
        for slot, value in optimizer_state[parameter].items():
            dense_optim[f"{name}.{slot}"] = host(value)
    state["optim"]["dense"] = dense_optim
    state["progress"] = {"step": torch.tensor(step, dtype=torch.int64)}
    return state
