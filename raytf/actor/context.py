"""What a loop and a train_fn see of their task (TaskContext, the user's `ctx`). Progress goes into
`ctx.channel`, the task's channel to the driver (raytf.actor.channel): raytf's loops call it directly, a
train_fn through ctx.step and ctx.report.

No TensorFlow import here.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

from raytf.errors import NonFiniteLoss
from raytf.actor.channel import TaskChannel
from raytf.actor.uploads import Uploads
from raytf.protocol import DrainStop, WorkerPayload
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
    """A task's view of itself, and a train_fn's `ctx`. Its progress goes into `channel`, which the driver polls.

    For `train_fn` users: `strategy` (and `coordinator` under parameter servers), `rank`, `world_size`,
    `num_replicas`, `per_replica_batch_size`,
    `global_batch_size`, `steps_per_epoch`, `validation_steps`, `is_chief`, `spec`, `config`, `build_model()`;
    `dataset(name)` / `distributed_dataset(name)` (this worker's shard of the job's data),
    `checkpoint(model=..., optimizer=...)` (save(step) / restore()), `step(step, loss)` as steps go,
    `report(metrics)` once per epoch (the chief's also go to <output.dir>/tensorboard), and `save_model(model)`
    on every worker (it syncs BatchNormalization statistics; the chief's copy becomes <output.dir>/model.keras).
    `output_dir`: the task's working folder: what the chief's script writes there (TensorBoard logs,
    ModelCheckpoint files, `model.save("my_model.keras")`, relative paths included) comes home in
    <output.dir>/outputs/. raytf.actor.own_loop implements them.
    """

    def __init__(self, rank: int, world_size: int, spec: JobSpec, staging_dir: str,
                 payload: WorkerPayload | None = None, channel: TaskChannel | None = None):
        self.rank, self.world_size, self.spec = rank, world_size, spec
        self.channel = channel or TaskChannel(rank)
        self.checkpoint_uploads = Uploads(self.channel)  # raytf's: the chief's background checkpoint uploads
        self.config = dict(spec.config)  # the job's free-form config: section (Ray Train's train_loop_config)
        self.is_chief = rank == 0
        self.global_batch_size = spec.train.global_batch_size
        self.staging_dir = staging_dir
        # a train_fn's, set by attach()
        self.strategy = None
        self.coordinator = None  # a parameter-server train_fn: the chief's tf.distribute.coordinator.ClusterCoordinator
        self.num_replicas = None
        self.per_replica_batch_size = None
        self.steps_per_epoch: int | None = None  # train_fn with data: optimizer steps per epoch on every worker
        self.validation_steps: int | None = None  # train_fn with data.validation: batches per pass, every worker
        self.own_loop = None  # train_fn: raytf.actor.own_loop.OwnLoop (data and checkpoints)
        self.state_sync: Callable[[Any], None] | None = None  # makes replicas' non-trainable state agree
        # what a train_fn did
        self.history: list[dict[str, Any]] = []
        self.rescue = None  # raytf's loop: this task's state when a peer died (raytf.actor.rescue), for the driver
        self.global_step = 0
        self.restored_step = 0  # the step a train_fn's checkpoint restored
        self.saved_model = None
        self.exports: dict[str, str] = {}  # format -> path in staging_dir, from save_model
        self._payload = payload
        self._epoch_started = time.time()  # a train_fn's epoch, for report()
        self.output_dir: str | None = None  # the task's working folder (raytf.actor.task_actor sets it)
        self._writer = None  # the chief's TensorBoard writer for a train_fn's epochs, made at the first report

    def attach(self, own_loop, state_sync: Callable[[Any], None] | None = None) -> None:
        """raytf.actor.own_loop, before the train_fn runs: the strategy, data plan and checkpoints behind
        this ctx (an OwnLoop), and how save_model makes the replicas' state agree."""
        self.own_loop, self.state_sync = own_loop, state_sync
        self.strategy, self.coordinator = own_loop.strategy, own_loop.coordinator
        self.num_replicas = own_loop.strategy.num_replicas_in_sync
        self.per_replica_batch_size = own_loop.per_replica_batch_size
        self.steps_per_epoch, self.validation_steps = own_loop.steps_per_epoch, own_loop.validation_steps

    def restored(self, history: list[dict[str, Any]], step: int) -> None:
        """A train_fn's checkpoint was restored: ctx.report goes on numbering its epochs from there."""
        self.history = [dict(h) for h in history]
        self.global_step = self.restored_step = step
        self.channel.start_at(step)
        self.channel.phase("train")

    # -- for train_fn users
    def step(self, step: int, loss=None) -> None:
        """Call it as optimizer steps go (`step`: steps done so far, counted from the start of training): the
        progress line shows it, and the hang watchdog (failure.hang_timeout_s) sees the loop is alive."""
        spe = self.steps_per_epoch
        epoch, in_epoch = (step // spe + 1, step % spe) if spe else (len(self.history) + 1, step)
        self.global_step = step
        self.channel.train_step(epoch, in_epoch, spe, step, loss, self.global_batch_size)
        if self.channel.stop_due(step) and self.own_loop is not None:  # a drain notice: checkpoint here, then stop
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
        self.channel.epoch_end(entry)
        if self.is_chief and self.spec.output.tensorboard:
            self._tensorboard(entry)

    def _tensorboard(self, entry: dict[str, Any]) -> None:
        """A train_fn's epoch as raytf's loop writes its own: each number a scalar at step = epoch."""
        import tensorflow as tf

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.staging_dir, "tensorboard"))
        with self._writer.as_default(step=entry["epoch"]):
            for key, value in entry.items():
                if key not in ("epoch", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    tf.summary.scalar(key, float(value))
        self._writer.flush()

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
