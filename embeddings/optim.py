"""The fused optimizer of a SparseCore embedding module, as TorchRec sees it.

The update runs inside the backward (`embeddings.lookup`); `SparseCoreFusedOptimizer` is the
TorchRec `FusedOptimizer` in front of it, so TorchRec's utilities (`CombinedOptimizer`,
`KeyedOptimizer.state_dict` / `load_state_dict`, warm-up wrappers) and `torch.optim.lr_scheduler`
work with it:

* `param_groups[0]["lr"]` is the learning rate. As with FBGEMM's fused optimizers, `step()` and
  `zero_grad()` copy it into the learning-rate tensor the update reads, so a scheduler's change
  takes effect from the next backward, without recompiling.
* `params` are keyed by TorchRec's names (`embedding_bags.<table>.weight`); they are `meta`
  tensors of the table's shape, because the values live stacked and sharded on the device.
* `state` is keyed like FBGEMM's fused optimizer (`<table>.momentum1` for the first slot,
  `<table>.exp_avg_sq` for Adam's second, the `sparsecore` slot name otherwise, and
  `<table>.step`, the update count), with host copies of the current values; loading writes
  them back to the device (`post_load_state_dict`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torchrec.optim.fused import FusedOptimizer

from embeddings.state import StackedState, TableSlot
from sparsecore.optimizers import OptimizerSpec

__all__ = ["STEP_KEY", "SparseCoreFusedOptimizer", "state_key"]

_FBGEMM_SLOT_NAMES = {("adam", "velocity"): "exp_avg_sq"}
STEP_KEY = "step"


def state_key(optimizer: OptimizerSpec, slot: str) -> str:
    """TorchRec's name of a `sparsecore` slot (without the "<table>." prefix)."""
    names = [s.name for s in optimizer.slots()]
    if names and slot == names[0]:
        return "momentum1"
    return _FBGEMM_SLOT_NAMES.get((type(optimizer).NAME, slot), slot)


class SparseCoreFusedOptimizer(FusedOptimizer):
    """TorchRec's `FusedOptimizer` over a module's `StackedState` (see the module docstring)."""

    def __init__(self, state: StackedState, optimizer: OptimizerSpec, tables: list[str], prefix: str) -> None:
        self._state = state
        self._optimizer = optimizer
        self._keys = {table: f"{prefix}{table}.weight" for table in tables}
        self._params = {
            self._keys[table]: torch.empty(state.table_slot(table, None).shape, device="meta") for table in tables
        }
        self._param_group: dict[str, Any] = {
            "params": list(self._params.values()),
            "lr": float(optimizer.learning_rate),
        }
        self._snapshot: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.defaults: dict[str, Any] = {"_save_param_groups": False}
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        self._patch_step_function()

    @property
    def optimizer(self) -> OptimizerSpec:
        return self._optimizer

    @property
    def weight_keys(self) -> dict[str, str]:
        """TorchRec's weight name of each table, by table name."""
        return dict(self._keys)

    @property
    def params(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._params

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [self._param_group]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:  # type: ignore[override]
        """Host copies of every table's optimizer state (every process must read it together)."""
        snapshot = {}
        for table, key in self._keys.items():
            entries = {}
            for where in self.slots(table):
                entries[f"{table}.{state_key(self._optimizer, where.slot)}"] = torch.from_numpy(
                    self._state.to_host(where)
                )
            entries[f"{table}.{STEP_KEY}"] = torch.tensor(self._state.step_count(table))
            snapshot[self._params[key]] = entries
        self._snapshot = snapshot
        return snapshot

    def slots(self, table: str) -> list[TableSlot]:
        """The optimizer slots of `table`."""
        return [self._state.table_slot(table, slot.name) for slot in self._optimizer.slots()]

    def post_load_state_dict(self) -> None:
        """Write the state `load_state_dict` copied into the last `state` snapshot to the device."""
        slots, steps = {}, {}
        for table, key in self._keys.items():
            entries = self._snapshot.get(self._params[key])
            if entries is None:
                continue
            for where in self.slots(table):
                slots[where] = entries[f"{table}.{state_key(self._optimizer, where.slot)}"].numpy()
            steps[table] = float(entries[f"{table}.{STEP_KEY}"])
        self._state.load_host_tables(slots)
        for table, step in steps.items():
            self._state.set_step_count(table, step)

    def set_optimizer_step(self, step: int) -> None:
        """Set every table's update count (Adam's bias correction reads it)."""
        for table in self._keys:
            self._state.set_step_count(table, float(step))

    def step(self, closure: Any = None) -> None:
        """Nothing to apply (the backward did); makes the current learning rate take effect."""
        self._sync_learning_rate()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """No gradients to clear; makes the current learning rate take effect."""
        self._sync_learning_rate()

    def _sync_learning_rate(self) -> None:
        self._state.set_hyperparameter("learning_rate", self._param_group["lr"])
