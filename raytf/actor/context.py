"""What the driver hands each actor (WorkerPayload) and what a loop sees of its task (TaskContext).

No TensorFlow import here: the driver builds payloads, actors build contexts.
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable

from raytf.errors import NonFiniteLoss
from raytf.protocol import DrainStop, Progress, StopAnswer, WorkerPayload
from raytf.spec import JobSpec


def check_loss(spec: JobSpec, loss: Any, epoch: int, step: int, rank: int) -> None:
    """An epoch's loss that is NaN or infinite stops the job (train.nonfinite_loss: stop), before it is
    checkpointed or exported. Every rank sees the same all-reduced loss, so every rank stops together."""
    if spec.train.nonfinite_loss == "stop" and isinstance(loss, (int, float)) and not math.isfinite(loss):
        raise NonFiniteLoss(float(loss), epoch, step, rank)


class StopTraining(BaseException):
    """Raised out of a train_fn's ctx.step at the step a drain notice set, once the checkpoint there is
    written; raytf catches it. A BaseException, so a train_fn's `except Exception` does not swallow it."""

    def __init__(self, info: DrainStop):
        super().__init__(f"stopped at step {info.step} for a drain notice")
        self.info = info


class TaskContext:
    """A task's view of itself, and its channel to the driver: progress (read by the driver while the
    loop runs, from another thread of the actor) and per-epoch metrics.

    For `train_fn` users: `strategy` (and `coordinator` under parameter servers), `rank`, `world_size`,
    `num_replicas`, `per_replica_batch_size`,
    `global_batch_size`, `steps_per_epoch`, `validation_steps`, `is_chief`, `spec`, `build_model()`;
    `dataset(name)` / `distributed_dataset(name)` (this worker's shard of the job's data),
    `checkpoint(model=..., optimizer=...)` (save(step) / restore()), `step(step, loss)` as steps go,
    `report(metrics)` once per epoch, and `save_model(model)` on every worker (it syncs BatchNormalization
    statistics; the chief's copy becomes <output.dir>/model.keras). raytf.actor.own_loop implements them.
    """

    def __init__(self, rank: int, world_size: int, spec: JobSpec, staging_dir: str,
                 payload: WorkerPayload | None = None, report_interval_s: float = 0.5):
        self.rank, self.world_size, self.spec = rank, world_size, spec
        self.config = dict(spec.config)  # the job's free-form config: section (Ray Train's train_loop_config)
        self.is_chief = rank == 0
        self.global_batch_size = spec.train.global_batch_size
        self.staging_dir = staging_dir
        self.strategy = None
        self.coordinator = None  # a parameter-server train_fn: the chief's tf.distribute.coordinator.ClusterCoordinator
        self.num_replicas = None
        self.per_replica_batch_size = None
        self.history: list[dict[str, Any]] = []
        self.global_step = 0
        self.saved_model = None
        self.exports: dict[str, str] = {}  # format -> path in staging_dir, from save_model
        self.state_sync: Callable[[Any], None] | None = None  # set by the loop that owns the strategy
        self.steps_per_epoch: int | None = None  # train_fn with data: optimizer steps per epoch on every worker
        self.validation_steps: int | None = None  # train_fn with data.validation: batches per pass, every worker
        self.restored_step = 0  # the step a train_fn's checkpoint restored
        self.own_loop = None  # train_fn: raytf.actor.own_loop.OwnLoop (data and checkpoints)
        self._payload = payload
        self._lock = threading.Lock()
        self._report_interval_s = report_interval_s
        self._last_report = (0.0, 0)  # (when, global step) of the last full progress report
        self._progress = Progress(rank=rank, pid=os.getpid(), updated=time.time())
        self.first_step_at: float | None = None
        self._epoch_started = time.time()  # a train_fn's epoch, for report()
        self._epochs: list[dict[str, Any]] = []
        self._evaluations: list[dict[str, Any]] = []
        self._stop_at: int | None = None  # a drain notice: the step the loop stops and checkpoints at
        self.stop_requested_at: float | None = None
        self._last_step = 0  # the last step the loop finished, as stop_due saw it

    # -- a drain notice (raytf.driver.controller): every loop-running rank stops at one common step
    def request_stop(self, step: int) -> StopAnswer:
        """Stop after optimizer step `step`. Accepted only while the loop has not finished it yet (it may
        be inside the step after the last one it finished), so every rank that accepts stops at exactly
        `step`; the driver gives up on the checkpoint when one does not accept."""
        with self._lock:
            accepted = step > self._last_step
            if accepted:
                self._stop_at, self.stop_requested_at = step, time.time()
            return StopAnswer(accepted, self._last_step)

    def stop_due(self, step: int) -> bool:
        """Called by the loop after each optimizer step (`step`: done so far): whether to stop here."""
        with self._lock:
            self._last_step = step
            return self._stop_at is not None and step >= self._stop_at

    @property
    def stop_requested(self) -> bool:
        return self._stop_at is not None

    def checkpointed(self, seconds: float) -> None:
        """How long the last checkpoint took: the driver compares it with a draining node's deadline."""
        with self._lock:
            self._progress = dataclasses.replace(self._progress, checkpoint_s=round(seconds, 3))

    # -- progress, called by raytf's loop on every step; cheap unless a report is due
    def train_step(self, epoch: int, step: int, steps: int | None, global_step: int, loss, examples: int) -> None:
        now = time.time()
        self.global_step = global_step
        if self.first_step_at is None:
            self.first_step_at = now
        if now - self._last_report[0] < self._report_interval_s and step != steps:
            with self._lock:
                self._progress = dataclasses.replace(self._progress, global_step=global_step, updated=now)
            return
        (then, step_then), self._last_report = self._last_report, (now, global_step)
        rate = (global_step - step_then) / (now - then) if then and now > then else None
        with self._lock:
            self._progress = dataclasses.replace(
                self._progress, phase="train", epoch=epoch, step=step, steps=steps, global_step=global_step,
                loss=float("nan") if loss is None else float(loss), examples_seen=examples * global_step, updated=now,
                # since the last report: a drain's stop step
                steps_per_s=round(rate, 2) if rate is not None else self._progress.steps_per_s)

    def work_done(self) -> None:
        """A unit of work finished that is not an optimizer step this task took (a parameter-server worker
        ran a function the chief's train_fn scheduled): progress for the hang watchdog."""
        with self._lock:
            self._progress = dataclasses.replace(self._progress, work_done=self._progress.work_done + 1)

    def phase(self, name: str) -> None:
        """A named stretch of work (validating, checkpointing, restoring): progress for the hang watchdog."""
        with self._lock:
            self._progress = dataclasses.replace(self._progress, phase=name, updated=time.time())
        self._last_report = (0.0, 0)  # steps_per_s starts over after this: it measures stepping only

    def epoch_end(self, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._epochs.append(dict(metrics))
            self._progress = dataclasses.replace(self._progress, phase="epoch_end", updated=time.time())
        self._last_report = (0.0, 0)

    def evaluation(self, metrics: dict[str, Any]) -> None:
        """The evaluator side-car's result for one checkpoint."""
        with self._lock:
            self._evaluations.append(dict(metrics))
            self._progress = dataclasses.replace(self._progress, phase="evaluated", updated=time.time())

    def progress(self) -> Progress:
        """The latest step, and every epoch's metrics so far (so a slow poller misses none)."""
        with self._lock:
            return dataclasses.replace(self._progress, epochs=tuple(self._epochs), evaluations=tuple(self._evaluations),
                                       cpu_s=time.process_time())

    # -- for train_fn users
    def step(self, step: int, loss=None) -> None:
        """Call it as optimizer steps go (`step`: steps done so far, counted from the start of training): the
        progress line shows it, and the hang watchdog (failure.hang_timeout_s) sees the loop is alive."""
        spe = self.steps_per_epoch
        epoch, in_epoch = (step // spe + 1, step % spe) if spe else (len(self.history) + 1, step)
        self.train_step(epoch, in_epoch, spe, step, loss, self.global_batch_size)
        if self.stop_due(step) and self.own_loop is not None:  # a drain notice: checkpoint here, then stop
            self.own_loop.stop_here(step)

    def dataset(self, name: str = "train", epoch: int | None = None, skip: int = 0):
        """This worker's shard of data.train ("train") or data.validation ("validation") as a tf.data.Dataset
        of per-replica batches, read as raytf's loop reads it (every row in exactly one worker's shard).

        train: `epoch=None` is every epoch, endless (epoch e is batches (e-1)*steps_per_epoch .. e*steps_per_epoch,
        reshuffled each epoch from train.seed), starting `skip` optimizer steps in (the step a checkpoint
        restored); `epoch=k` is just epoch k, steps_per_epoch batches on every worker, less the first `skip`.
        validation: one pass, every row once, as (x, y, weight) with weight 0 on the padding rows that give
        every worker validation_steps batches."""
        return self._own_loop("dataset").dataset(name, epoch, skip)

    def distributed_dataset(self, name: str = "train", epoch: int | None = None, skip: int = 0):
        """`dataset(...)` for `strategy.run`: a tf.distribute.DistributedDataset of the same batches."""
        return self._own_loop("distributed_dataset").distributed_dataset(name, epoch, skip)

    def checkpoint(self, **trackables):
        """The job's checkpoints for a train_fn: `ckpt = ctx.checkpoint(model=model, optimizer=optimizer)`,
        then `step = ckpt.restore()` (the step restored after a restart or with --resume; None when starting
        fresh) and `ckpt.save(step)` on every worker (the chief uploads to checkpoint.dir)."""
        return self._own_loop("checkpoint").checkpoint(trackables)

    def _own_loop(self, what: str):
        if self.own_loop is None:
            raise RuntimeError(f"ctx.{what}() is for a train_fn")
        return self.own_loop

    def report(self, metrics: dict[str, Any]) -> None:
        """Record one epoch's metrics (floats); the driver shows them and writes them to result.json."""
        now = time.time()
        entry = {"epoch": len(self.history) + 1, **{k: (float(v) if not isinstance(v, (int, str)) else v)
                                                     for k, v in metrics.items()}}
        check_loss(self.spec, entry.get("loss"), entry["epoch"], int(entry.get("step", self.global_step)), self.rank)
        entry.setdefault("seconds", round(now - self._epoch_started, 3))
        self._epoch_started = now
        self.history.append(entry)
        self.global_step = int(entry.get("step", self.global_step))
        if self.first_step_at is None:
            self.first_step_at = time.time()
        self.epoch_end(entry)

    def build_model(self):
        if self._payload is None or self.spec.model is None:
            raise ValueError("the job spec names no model function")
        return self._payload.function("model")()

    def save_model(self, model) -> None:
        """Call it on every worker: it first makes each replica's BatchNormalization statistics (and any
        other non-trainable float state) the mean over all replicas, a collective, so every worker ends
        with the same model. Every worker writes it, the chief for output.dir and the others to a scratch
        folder: a tf.keras (Keras 2) save reads its metrics' sync-on-read variables with a collective that
        every worker must join (a chief saving alone waits forever)."""
        import tempfile

        from raytf.actor import export

        if self.state_sync is not None:
            self.state_sync(model)
        self.saved_model = model
        if self.is_chief:
            self.exports = export.write(model, self._payload, self.staging_dir)
        else:
            with tempfile.TemporaryDirectory(prefix="raytf-scratch-") as scratch:
                export.write(model, self._payload, scratch)
