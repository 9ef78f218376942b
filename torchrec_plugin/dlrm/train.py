"""The training loop: steps fed by a prefetching loader, held-out evaluation, checkpoints, summary.

`train(training, source, options)` runs steps `start+1 .. options.steps` of `training` (a
`model.DLRMTraining`) on `source`'s batches: each batch is made and moved to the device on the
loader's worker thread while the previous step runs; the step is the BCE loss of DLRM-DCN's
logit, one backward (which applies the tables' fused Adagrad) and the dense Adagrad step. Every
`eval_every` steps the held-out AUC and log-loss are measured, every `checkpoint_every` steps a
checkpoint is written; `resume` continues from the last checkpoint. Modes: `strict` and `defer`
(the eager executors) or `compiled` (`torch.compile(backend="tpu")` over the model).

Launches of multi-device programs are serialised between the training thread and the loader's
worker (`_LAUNCHES`): on XLA:CPU, two threads launching programs over the same devices at once
can order them differently per device, and a collective then waits forever for its peers (seen
here as a rendezvous timeout). The worker makes the batch on the host unlocked and takes the lock
only for `prepare` (the transfer to the device).

With several processes each trains on its own samples and every weight moves by the gradient
of the mean loss over all processes' samples, as under TorchRec's DMP: the sharded tables
average their gradients over processes, and the dense gradients are all-reduced and divided by
the process count (DDP's job, done here in one flat collective).

After the warm-up, every object then alive (the model, the runtime's caches, the imported
libraries: some 700k on the `mlperf` preset) is moved out of the cyclic garbage collector's reach
(`gc.freeze`), as long-running Python services do: a full collection otherwise walks them all,
0.2-2 s each on this preset, and stalls whichever step it lands in. `train` undoes it on return.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from tqdm import tqdm

import torchtpu
from embeddings import PrefetchingLoader
from torchrec_plugin.dlrm import checkpoint
from torchrec_plugin.dlrm.evaluation import Evaluation, evaluate
from torchrec_plugin.dlrm.model import DLRMTraining, PreparedBatch

__all__ = ["MODES", "BatchSource", "Summary", "TrainOptions", "train"]

MODES = ("strict", "defer", "compiled")
WARMUP_STEPS = 3
"""Steps left out of the throughput (they compile the step's programs)."""


_LAUNCHES = threading.Lock()
"""Held while a thread launches device programs (see the module docstring)."""


class BatchSource(Protocol):
    """Where batches come from: this process's samples of any training step, and held-out ones."""

    def train_batch(self, step: int) -> Batch: ...

    def held_out_batch(self, index: int) -> Batch: ...


@dataclass(frozen=True)
class TrainOptions:
    """`steps`: the last step to run. `eval_every` / `checkpoint_every`: 0 means only at the end.
    `precision`: the tpu matmul precision (`default` multiplies in bf16, as a TPU does).
    `autocast`: forward passes (training and held-out) under `torch.autocast("tpu")`: activations
    of the matmuls in bfloat16, the loss in float32; backward and optimizer steps outside it."""

    steps: int
    mode: str = "defer"
    eval_every: int = 0
    eval_batches: int = 8
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume: bool = False
    log_every: int = 10
    prefetch_depth: int = 2
    precision: str = "default"
    autocast: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.steps < 1:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint directory")


@dataclass
class Summary:
    """What a run did. `losses[i]` is the loss of step `start_step + 1 + i` (this process's view
    of the global mean). Throughput and input wait cover the steps after the warm-up."""

    config: str
    mode: str
    processes: int
    batch_size: int
    start_step: int
    losses: list[float] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)
    timed_steps: int = 0
    timed_seconds: float = 0.0
    input_wait_seconds: float = 0.0
    checkpoints: int = 0

    @property
    def examples_per_second(self) -> float:
        """Global examples per second of the timed steps."""
        return self.timed_steps * self.batch_size * self.processes / max(self.timed_seconds, 1e-9)

    @property
    def input_wait_share(self) -> float:
        """Share of the timed steps' time spent waiting for the next batch."""
        return self.input_wait_seconds / max(self.timed_seconds, 1e-9)

    def report(self) -> str:
        lines = [
            f"DLRM-DCN '{self.config}' on tpu, {self.mode} mode, {self.processes} process(es) x batch "
            f"{self.batch_size}: steps {self.start_step + 1}-{self.start_step + len(self.losses)}",
        ]
        if self.losses:
            lines.append(f"  loss: first {self.losses[0]:.4f}, last {self.losses[-1]:.4f}")
        if self.evaluations:
            last = self.evaluations[-1]
            lines.append(f"  held-out at step {last.step}: AUC {last.auc:.4f}, log-loss {last.log_loss:.4f} "
                         f"({last.samples} samples per process)")
        if self.timed_steps:
            lines.append(f"  throughput: {self.examples_per_second:,.0f} examples/s over {self.timed_steps} steps; "
                         f"waiting for input {100 * self.input_wait_share:.1f}% of the time")
        if self.checkpoints:
            lines.append(f"  checkpoints written: {self.checkpoints}")
        return "\n".join(lines)


def train(training: DLRMTraining, source: BatchSource, options: TrainOptions) -> Summary:
    """Run the job (see the module docstring); every process of a multi-process job calls it."""
    start = checkpoint.restore(training, options.checkpoint_dir) if options.resume else 0
    if start > options.steps:
        raise ValueError(f"the checkpoint in {options.checkpoint_dir} is at step {start}, past --steps {options.steps}")
    processes = dist.get_world_size() if dist.is_initialized() else 1
    summary = Summary(training.config.name, options.mode, processes, training.config.batch_size, start)
    forward = _forward(training, options.mode)
    with torchtpu.matmul_precision(options.precision), torchtpu.eager_mode(_eager_mode(options.mode)):
        held_out = [training.prepare(source.held_out_batch(i)) for i in range(options.eval_batches)]
        batches = (source.train_batch(step) for step in range(start + 1, options.steps + 1))
        with PrefetchingLoader(batches, _locked(training.prepare), options.prefetch_depth) as loader, \
                _collector_spares_warm_objects() as after_warmup:
            _run(training, forward, loader, held_out, options, summary, after_warmup)
    return summary


@contextlib.contextmanager
def _collector_spares_warm_objects() -> Iterator[Callable[[], None]]:
    """A function that freezes the objects alive when it is called (`gc.freeze`, after a full
    collection), unfrozen on exit; a no-op if the caller has already frozen some."""
    froze = False

    def freeze() -> None:
        nonlocal froze
        if not froze and gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
            froze = True

    try:
        yield freeze
    finally:
        if froze:
            gc.unfreeze()


def _run(
    training: DLRMTraining,
    forward,
    loader: PrefetchingLoader,
    held_out: list[PreparedBatch],
    options: TrainOptions,
    summary: Summary,
    after_warmup: Callable[[], None],
) -> None:
    pending: list[torch.Tensor] = []
    progress = _progress_bar(summary, options)
    timer = _Timer(loader)
    for step, batch in enumerate(loader, summary.start_step + 1):
        with _LAUNCHES:
            pending.append(_train_step(training, forward, batch, summary.processes, options.autocast))
        last = step == options.steps
        if step - summary.start_step == WARMUP_STEPS:
            _flush(pending, summary)
            after_warmup()
            timer.start()
        if step % options.log_every == 0 or last:
            _flush(pending, summary)
            if progress is not None:
                progress.update(step - progress.n)
                progress.set_postfix(loss=f"{summary.losses[-1]:.4f}", ex_s=f"{timer.rate(summary):,.0f}")
        if (options.eval_every and step % options.eval_every == 0) or last:
            _flush(pending, summary)
            with timer.paused(), _LAUNCHES, torch.autocast("tpu", enabled=options.autocast):
                summary.evaluations.append(evaluate(forward, held_out, step))
            if progress is not None:
                progress.write(_describe(summary.evaluations[-1]))
            elif _is_first_process():
                print(_describe(summary.evaluations[-1]), flush=True)
        if options.checkpoint_dir is not None and (
            (options.checkpoint_every and step % options.checkpoint_every == 0) or last
        ):
            _flush(pending, summary)
            with timer.paused(), _LAUNCHES:
                checkpoint.save(training, step, options.checkpoint_dir)
            summary.checkpoints += 1
    _flush(pending, summary)
    timer.stop(summary)
    if progress is not None:
        progress.close()


def _train_step(training: DLRMTraining, forward, batch: PreparedBatch, processes: int,
                autocast: bool) -> torch.Tensor:
    with torch.autocast("tpu", enabled=autocast):
        logits = forward(batch.dense, batch.sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    training.dense_optimizer.zero_grad()
    loss.backward()
    if processes > 1:
        _all_reduce_dense_gradients(training, scale=1.0 / processes)
    training.dense_optimizer.step()
    return loss.detach()


def _locked(prepare: Callable[[Batch], PreparedBatch]) -> Callable[[Batch], PreparedBatch]:
    def locked(batch: Batch) -> PreparedBatch:
        with _LAUNCHES:
            return prepare(batch)

    return locked


def _all_reduce_dense_gradients(training: DLRMTraining, scale: float) -> None:
    """Sum the dense gradients over processes, times `scale` (one flat collective per step)."""
    grads = [p.grad for p in training.dense_parameters().values() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat = flat * scale
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def _forward(training: DLRMTraining, mode: str):
    return torch.compile(training.model, backend="tpu") if mode == "compiled" else training.model


def _eager_mode(mode: str) -> str:
    """The eager executor of a mode (compiled graphs run under strict)."""
    return "strict" if mode == "compiled" else mode


def _flush(pending: list[torch.Tensor], summary: Summary) -> None:
    """Read the pending losses (waits for their steps)."""
    if pending:
        with _LAUNCHES:  # in defer mode, reading runs the pending program
            summary.losses.extend(float(loss) for loss in pending)
        pending.clear()


class _Timer:
    """Wall time of the timed steps, without evaluation and checkpoint pauses."""

    def __init__(self, loader: PrefetchingLoader) -> None:
        self._loader = loader
        self._started: float | None = None
        self._waited = 0.0
        self._step0 = 0
        self._paused = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()
        self._waited = self._loader.waited_seconds
        self._step0 = self._loader.batches

    def rate(self, summary: Summary) -> float:
        if self._started is None:
            return 0.0
        seconds = time.perf_counter() - self._started - self._paused
        return (self._loader.batches - self._step0) * summary.batch_size * summary.processes / max(seconds, 1e-9)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - begin

    def stop(self, summary: Summary) -> None:
        if self._started is None:
            return
        summary.timed_seconds = time.perf_counter() - self._started - self._paused
        summary.timed_steps = self._loader.batches - self._step0
        summary.input_wait_seconds = self._loader.waited_seconds - self._waited


def _progress_bar(summary: Summary, options: TrainOptions) -> tqdm | None:
    if not options.progress or not _is_first_process():
        return None
    return tqdm(total=options.steps, initial=summary.start_step, unit="step", dynamic_ncols=True)


def _is_first_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _describe(evaluation: Evaluation) -> str:
    return f"step {evaluation.step}: held-out AUC {evaluation.auc:.4f}, log-loss {evaluation.log_loss:.4f}"
