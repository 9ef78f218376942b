"""Held-out evaluation: AUC (torchmetrics) and log-loss over fixed batches the model never trains on.

The held-out batches are prepared once (on the device) and scored under `torch.no_grad()`, so
evaluating changes neither the tables (no backward, no fused update) nor the dense layers. With
several processes each scores its own samples and torchmetrics gathers them for the AUC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torchmetrics.classification import BinaryAUROC
from torchmetrics.aggregation import MeanMetric

from torchrec_plugin.dlrm.model import PreparedBatch

__all__ = ["Evaluation", "evaluate"]

Forward = Callable[[torch.Tensor, object], torch.Tensor]


@dataclass(frozen=True)
class Evaluation:
    step: int
    auc: float
    log_loss: float
    samples: int


def evaluate(forward: Forward, batches: Sequence[PreparedBatch], step: int) -> Evaluation:
    """AUC and mean log-loss of `forward`'s click probabilities on `batches` (every process's)."""
    auc, log_loss = BinaryAUROC(), MeanMetric()
    with torch.no_grad():
        for batch in batches:
            logits = forward(batch.dense, batch.sparse).squeeze(-1).float().cpu()  # bfloat16 under autocast
            labels = batch.labels.cpu()
            auc.update(torch.sigmoid(logits), labels.to(torch.int64))
            losses = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
            log_loss.update(losses)
    samples = sum(int(batch.labels.shape[0]) for batch in batches)
    return Evaluation(step=step, auc=float(auc.compute()), log_loss=float(log_loss.compute()), samples=samples)
