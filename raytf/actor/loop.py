"""The one training loop both strategies run, inside the actor that drives training (every worker under
MultiWorkerMirrored, the chief under parameter servers).

It owns what the strategies share: the epoch and step plan, the epoch's metric sums (exact over all
replicas, and saved in mid-epoch checkpoints, so a resumed epoch reports the same metrics as an
uninterrupted one), the BatchNormalization sync, validation, TensorBoard, checkpoints through
raytf.checkpoint.Storage, and progress for the watchdog. A strategy supplies a `Runner`: how its steps run
(strategy.run or ClusterCoordinator.schedule) and where its sums and checkpoint state come from.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import tensorflow as tf

from raytf.actor import rescue as rescue_lib
from raytf.actor import schedules
from raytf.actor import steps as steps_lib
from raytf.actor.context import TaskContext, check_loss
from raytf.protocol import CheckpointSaved, DrainStop, Outcome, WorkerPayload
from raytf.checkpoint import META, CheckpointInfo, Storage
from raytf.errors import CheckpointCorrupt, CheckpointMismatch, NonFiniteWeights


class Runner(Protocol):
    """A strategy's steps, as the loop drives them."""

    steps: int  # optimizer steps per epoch
    optimizer: Any  # the Keras optimizer (its schedule gives each epoch's learning rate)
    train_acc: steps_lib.Accumulator
    eval_acc: steps_lib.Accumulator
    state: tf.train.Checkpoint  # what a checkpoint holds
    validates: bool  # whether each epoch ends with a pass over the validation rows here
    own_timing: bool  # whether timing()'s "worker-<rank>" is this task's own steps (not a coordinator's view)
    rescuable: bool  # whether this task holds the whole state, so a peer's death can be rescued (raytf.actor.rescue)

    def start_epoch(self, epoch: int, totals: np.ndarray | None) -> None: ...  # totals: restored sums
    # runs up to `count` steps, yielding each loss (or None); no new step once `stopping()` is true
    def train(self, count: int, epoch: int, stopping: Callable[[], bool]) -> Iterator[Any]: ...
    def epoch_totals(self) -> np.ndarray: ...  # this epoch's sums over all replicas so far
    def epoch_notes(self) -> dict[str, Any]: ...  # extra per-epoch metrics (steps whose metrics were lost)
    def sync_state(self) -> None: ...  # make per-replica state (BN statistics) agree
    def validate(self) -> np.ndarray | None: ...  # sums of one pass over the validation rows
    def checkpoint_options(self) -> tf.train.CheckpointOptions | None: ...
    def checkpoint_extras(self, local_dir: str) -> dict[str, Any]: ...  # more files and metadata to save
    def check_restorable(self, meta: dict[str, Any], path: str) -> None: ...
    def final_checkpoint_needed(self) -> bool: ...
    def timing(self) -> dict[str, dict[str, float]]: ...  # "worker-<i>" -> input wait, step time, steps so far
    def finish(self) -> Outcome: ...  # save the model; the outcome's strategy-specific part


class Position:
    """Where a loop starts: from scratch, or from a checkpoint (epoch, steps of it done, global step,
    the finished epochs' metrics, and for a mid-epoch checkpoint the epoch's metric sums so far)."""

    def __init__(self, epoch: int = 1, step_in_epoch: int = 0, global_step: int = 0, history=(), totals=None):
        self.epoch, self.step_in_epoch, self.global_step, self.history = epoch, step_in_epoch, global_step, history
        self.totals = totals


def run(runner: Runner, payload: WorkerPayload, ctx: TaskContext) -> Outcome:
    spec = payload.spec
    checkpoints = Checkpoints(runner, payload, ctx)
    position = checkpoints.restore()
    writer = steps_lib.summary_writer(ctx) if ctx.is_chief and spec.output.tensorboard else None
    history = list(position.history)
    trace = StepTrace(spec.output.profile, ctx)
    timing = TimingEvents(ctx) if spec.output.tensorboard else None
    ctx.channel.start_at(position.global_step)
    if runner.own_timing:  # for output.metrics (the ps chief's timing holds every worker's, not its own)
        ctx.channel.timing_source = lambda: runner.timing().get(f"worker-{ctx.rank}")
    rescue = Rescuer(runner, checkpoints, ctx, position)
    try:
        return _epochs(runner, spec, ctx, checkpoints, position, writer, history, trace, timing, rescue)
    except rescue_lib.PEER_LOST:  # a peer is gone: keep this task's state for the restart, then fail as before
        rescue.take(history)
        raise


def _epochs(runner: Runner, spec, ctx: TaskContext, checkpoints: "Checkpoints", position: Position, writer, history: list,
            trace: "StepTrace", timing: "TimingEvents | None", rescue: "Rescuer") -> Outcome:
    global_step = position.global_step
    every_kind, every = spec.checkpoint.interval
    for epoch in range(position.epoch, spec.train.epochs + 1):
        started = time.time()
        resuming = epoch == position.epoch and position.step_in_epoch > 0
        totals = np.asarray(position.totals, np.float64) if resuming and position.totals else None
        runner.start_epoch(epoch, totals)
        step = position.step_in_epoch if epoch == position.epoch else 0
        rescue.start_epoch(epoch, step, totals)
        while step < runner.steps:
            stop = runner.steps  # the next checkpoint, or the epoch's end
            if every_kind == "steps":
                stop = min(runner.steps, step + every - global_step % every)
            trace.before(global_step + 1)
            for loss in runner.train(stop - step, epoch, stopping=lambda: ctx.channel.stop_due(global_step)):
                step += 1
                global_step += 1
                rescue.at = (epoch, step, global_step)
                trace.after(global_step)
                if loss is not None:
                    ctx.channel.train_step(epoch, step, runner.steps, global_step, loss, spec.train.effective_batch_size)
            # Asked after every chunk, not only once a notice came: it records the step just finished, so a
            # notice arriving during the checkpoint or epoch end below is not accepted for a step this rank
            # has passed (the ranks would stop on different sides of those collectives).
            if ctx.channel.stop_due(global_step):  # a drain notice: checkpoint now, here
                trace.close()
                return stopped(runner, checkpoints, ctx, global_step, epoch, step, history, position)
            if checkpoints.enabled and every_kind == "steps" and global_step % every == 0 and step < runner.steps:
                runner.sync_state()
                checkpoints.save(global_step, epoch, step, history, runner.epoch_totals())
        runner.sync_state()  # before validation: every worker evaluates, and ends with, the same model
        metrics = runner.train_acc.results(runner.epoch_totals())
        check_loss(spec, metrics.get("loss"), epoch, global_step, ctx.rank)  # before it is validated or saved
        metrics.update(runner.epoch_notes())
        metrics["learning_rate"] = schedules.learning_rate_at(runner.optimizer, max(global_step - 1, 0))  # its last step's
        val = None
        if runner.validates:
            ctx.channel.phase("validating")
            val = runner.eval_acc.results(runner.validate())
        steps_lib.end_epoch(ctx, writer, history, metrics, val, epoch, started, global_step)
        if timing is not None:
            timing.write(runner.timing(), epoch)
        last = epoch == spec.train.epochs
        if steps_lib.checkpoint_due(spec.checkpoint.interval, global_step, epoch) or (
                last and runner.final_checkpoint_needed()):
            checkpoints.save(global_step, epoch + 1, 0, history)
    trace.close()
    check_weights(spec, getattr(runner, "model", None), spec.train.epochs, global_step if history else 0, ctx.rank)
    return dataclasses.replace(runner.finish(), history=history, steps=global_step,
                               steps_run=global_step - position.global_step, timing=runner.timing())


def check_weights(spec, model, epoch: int, step: int, rank: int) -> None:
    """Before the model is exported: weights that hold NaN or inf end the job (train.nonfinite_loss: stop),
    as a NaN loss does; NaN features can spoil weights while the reported loss stays finite."""
    if spec.train.nonfinite_loss != "stop" or model is None:
        return
    try:
        weights = model.get_weights()
    except Exception:  # a model TensorFlow cannot read back here: the loss check stands alone
        return
    bad = [i for i, w in enumerate(weights) if np.issubdtype(w.dtype, np.floating) and not np.isfinite(w).all()]
    if bad:
        name = model.weights[bad[0]].path if bad[0] < len(model.weights) else f"weight {bad[0]}"
        raise NonFiniteWeights(name, len(bad), epoch, step, rank)


def stopped(runner: Runner, checkpoints: "Checkpoints", ctx: TaskContext, global_step: int, epoch: int, step: int,
            history: list, position: Position) -> Outcome:
    """The loop stopped at the step a drain notice set: checkpoint there (a mid-epoch checkpoint, its metric
    sums included; at an epoch's last step too, so the resumed attempt ends that epoch), and return."""
    saved, reached = None, time.time()
    if checkpoints.enabled:
        runner.sync_state()
        started = time.time()
        checkpoints.save(global_step, epoch, step, history, runner.epoch_totals())
        ctx.checkpoint_uploads.complete()  # the restart resumes from it: uploaded before this task returns
        saved = CheckpointSaved(global_step, round(time.time() - started, 3))
    return Outcome(preempted=DrainStop(global_step, saved, round(reached - ctx.channel.stop_requested_at, 3)),
                   history=history, steps=global_step, steps_run=global_step - position.global_step)


class Rescuer:
    """What raytf.actor.rescue needs to keep this task's state when a peer dies (`take`): where the loop stands
    (`at`: epoch, steps of it done, global step, set after every step) and how the epoch's sums began. Only a
    runner that holds the whole state (MultiWorkerMirrored's), with a checkpoint.dir to upload it to."""

    def __init__(self, runner: Runner, checkpoints: "Checkpoints", ctx: TaskContext, position: Position):
        self.runner, self.checkpoints, self.ctx = runner, checkpoints, ctx
        self.enabled = runner.rescuable and checkpoints.enabled
        self.at = (position.epoch, position.step_in_epoch, position.global_step)
        # the optimizer's step count at the attempt's first step (a rescue sets it back to the steps done)
        self.first = (position.global_step, int(runner.optimizer.iterations.numpy()) if self.enabled else 0)
        self.epoch_base = self.local_base = None

    def start_epoch(self, epoch: int, step: int, totals) -> None:
        self.at = (epoch, step, self.at[2])
        self.epoch_base = totals
        self.local_base = totals if self.ctx.is_chief else None  # the chief's accumulator starts from them

    def take(self, history: list) -> None:
        """The state at the last step every worker finished, kept in the task (ctx.rescue) for the driver; none
        when it is no further than the newest checkpoint. Never raises: the peer's loss stays the error."""
        if not self.enabled or self.at[2] <= self.checkpoints.saved_step:
            return
        try:
            local = self.runner.train_acc.total.numpy()
            # The failed step ran what waits for no peer (its forward pass, the optimizer's step count, its metric
            # sums) but updated no variable (its all-reduce failed): its sums are taken back (measured:
            # benchmarks/survivor_state.py).
            if int(self.runner.optimizer.iterations.numpy()) > self.first[1] + self.at[2] - self.first[0]:
                local = local - self.runner.train_acc.last.numpy()
            totals = rescue_lib.estimated_totals(local, self.local_base, self.epoch_base, self.ctx.world_size)
            self.ctx.rescue = rescue_lib.take(self.runner.state, self.runner.optimizer, self.at, self.first, history,
                                              totals, self.ctx.world_size, self.runner.checkpoint_extras,
                                              self.checkpoints.payload.checkpoint_dir,
                                              self.checkpoints.payload.spec.checkpoint.keep)
        except Exception as exc:  # noqa: BLE001 -- the restart falls back to the last checkpoint
            print(f"raytf: rank {self.ctx.rank} could not keep its state for the restart ({exc!r}); the last "
                  f"checkpoint is used", flush=True)


class TimingEvents:
    """Each worker's input wait and step time per epoch as TensorBoard scalars, in a run per worker
    (tensorboard/timing/worker-<i>/), so TensorBoard draws the workers over each other. Written by the
    task that measured them (under parameter servers, the chief, for every worker)."""

    def __init__(self, ctx: TaskContext):
        self.root = os.path.join(ctx.staging_dir, "tensorboard", "timing")
        self.writers: dict[str, Any] = {}
        self.last: dict[str, dict[str, float]] = {}

    def write(self, timing: dict[str, dict[str, float]], epoch: int) -> None:
        for worker, totals in timing.items():
            if worker not in self.writers:
                self.writers[worker] = tf.summary.create_file_writer(os.path.join(self.root, worker))
            before = self.last.get(worker, {})
            with self.writers[worker].as_default(step=epoch):
                for key in ("input_wait_s", "step_s"):
                    tf.summary.scalar(key, totals[key] - before.get(key, 0.0))
            self.writers[worker].flush()
            self.last[worker] = totals


PROFILE_DIR = "tensorboard/profile"  # rank r's trace: tensorboard/profile/rank-r/plugins/profile/<run>/


class StepTrace:
    """output.profile: a tf.profiler trace of optimizer steps first..last on the asked ranks, into
    tensorboard/profile/rank-<r>/ (a run of its own for TensorBoard's profile plugin, so ranks on one host
    do not overwrite each other's <host>.xplane.pb). `before(n)` comes before step n runs, `after(n)` once
    it is done (steps run in order; under parameter servers they are the chief's scheduled steps)."""

    def __init__(self, profile, ctx: TaskContext):
        self.steps = profile.steps if profile is not None and ctx.rank in profile.ranks else None
        self.logdir = os.path.join(ctx.staging_dir, PROFILE_DIR, f"rank-{ctx.rank}")
        self.active = False

    def before(self, step: int) -> None:
        if self.steps is not None and not self.active and self.steps[0] <= step <= self.steps[1]:
            tf.profiler.experimental.start(self.logdir)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.steps[1]:
            self.close()
        elif self.steps is not None and not self.active:
            self.before(step + 1)

    def close(self) -> None:
        if self.active:
            tf.profiler.experimental.stop()
            self.active = False


class Checkpoints:
    """The runner's state through tf.train.Checkpoint, plus the position and the epoch's metric sums in
    raytf.json. Every process that runs the loop writes (a MultiWorkerMirrored save may run collectives),
    each to its own temporary folder; the chief uploads its copy through Storage, which writes raytf.json
    last (a checkpoint without it is never "latest"), then prunes to checkpoint.keep."""

    def __init__(self, runner: Runner, payload: WorkerPayload, ctx: TaskContext):
        self.runner, self.payload, self.ctx = runner, payload, ctx
        self.storage = Storage(payload.checkpoint_dir) if payload.checkpoint_dir else None
        self.saved_step = payload.resume_from.step if payload.resume_from else 0  # the newest this task knows

    @property
    def enabled(self) -> bool:
        return self.storage is not None

    def restore(self) -> Position:
        resume = self.payload.resume_from
        if resume is None:
            return Position()
        # A constant learning rate is a variable the checkpoint restores; the job's own is the one to train with
        # (a sweep's pbt may have given this trial another trial's checkpoint and a new rate).
        rate = schedules.constant_rate(self.runner.optimizer)
        meta = read_state(self.runner.state, resume, self.payload.checkpoint_dir, self.ctx,
                          self.runner.checkpoint_options(), check=self.runner.check_restorable)
        if rate is not None:
            schedules.set_constant_rate(self.runner.optimizer, rate)
        return Position(resume.epoch, resume.step_in_epoch, resume.step, resume.history, meta.get("epoch_totals"))

    def save(self, global_step: int, epoch: int, step_in_epoch: int, history: list,
             totals: np.ndarray | None = None) -> None:
        if self.storage is None:
            return

        def meta(local_dir: str) -> dict[str, Any]:
            return {"step": global_step, "epoch": epoch, "step_in_epoch": step_in_epoch, "history": history,
                    "epoch_totals": totals.tolist() if totals is not None else None,
                    **self.runner.checkpoint_extras(local_dir)}

        write_state(self.runner.state, self.storage, self.ctx, self.payload.spec.checkpoint.keep, meta,
                    self.runner.checkpoint_options())
        self.saved_step = global_step


def read_state(state: tf.train.Checkpoint, resume: CheckpointInfo, location: str, ctx: TaskContext,
               options: tf.train.CheckpointOptions | None = None, check=None, keep_in: str | None = None) -> dict[str, Any]:
    """Restore `state` from checkpoint `resume`; returns its raytf.json. A checkpoint that cannot be read is
    CheckpointCorrupt (naming it), which the driver answers by trying the one before. `check(meta, path)`
    may refuse it first. `keep_in`: download into this folder and leave the files there, for variables not
    created yet (an optimizer's, before its first step), which TensorFlow restores when they are created."""
    ctx.channel.phase("restoring")
    local = keep_in or tempfile.mkdtemp(prefix="raytf-restore-")
    try:
        try:
            Storage(location).download(resume, local)
            with open(os.path.join(local, META)) as f:
                meta = json.load(f)
        except Exception as exc:
            raise CheckpointCorrupt(resume.path, _first_line(exc)) from None
        if check is not None:
            check(meta, resume.path)
        try:
            state.read(os.path.join(local, "state"), options=options).assert_existing_objects_matched()
        except _MISMATCH as exc:  # it reads, but holds another model: no fallback, never a fresh start
            raise CheckpointMismatch(resume.path, _first_line(exc)) from None
        except Exception as exc:  # files missing, cut short or unreadable: the one before may do
            raise CheckpointCorrupt(resume.path, _first_line(exc)) from None
    finally:
        if keep_in is None:
            shutil.rmtree(local, ignore_errors=True)
    return meta


def write_state(state: tf.train.Checkpoint, storage: Storage, ctx: TaskContext, keep: int,
                meta: Callable[[str], dict[str, Any]], options: tf.train.CheckpointOptions | None = None) -> None:
    """Every process that runs the loop writes `state` (a MultiWorkerMirrored save may run collectives), each
    to a temporary folder of its own; the chief uploads its copy with raytf.json (`meta(its folder)` plus the
    world size and the time) written last, then prunes to `keep`."""
    ctx.channel.phase("checkpointing")
    started = time.time()
    local = tempfile.mkdtemp(prefix="raytf-ckpt-")
    try:
        state.write(os.path.join(local, "state"), options=options)
        if ctx.is_chief:
            saved = {**meta(local), "world_size": ctx.world_size, "saved_at": time.time()}
            if ctx.spec.checkpoint.background:
                ctx.checkpoint_uploads.submit(storage, local, saved, keep, started)  # removes `local` when done
                local = None
            else:
                storage.upload(local, saved)
                storage.prune(keep)
    finally:
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
    if local is not None:  # a background upload (local handed over) reports its time when it is done
        ctx.channel.checkpointed(time.time() - started)
    ctx.channel.phase("train")


# What TensorFlow raises for a checkpoint that reads but does not fit: "Received incompatible tensor with shape
# ..." (ValueError), variables without a value (assert_existing_objects_matched's AssertionError). Damaged
# files raise anything else (DataLossError, NotFoundError, IndexError "Read less bytes than requested", ...).
_MISMATCH = (ValueError, AssertionError)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
