"""train_fn: the user's own training loop, with what raytf's loop has: on every worker under
MultiWorkerMirroredStrategy, and on the chief under parameter servers (raytf.actor.ps_own_loop supplies
that strategy's data and checkpoint options).

The user's function gets a TaskContext (raytf.actor.context) whose data, checkpoint and progress calls land
here: this worker's shard of the job's `data:` section read by raytf's pipeline (ctx.dataset,
ctx.distributed_dataset), checkpoints through the job's checkpoint storage that a restart or `--resume`
restores (ctx.checkpoint), progress for the hang watchdog (ctx.step) and per-epoch metrics (ctx.report).

Under `train.keras: legacy` the actors run with TF_USE_LEGACY_KERAS=1 (raytf.driver.packaging), so `tf.keras`
is tf-keras (Keras 2), whose `model.fit` works under MultiWorkerMirrored; Keras 3's does not on TF 2.21.
"""
from __future__ import annotations

import random
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from raytf import backends
from raytf.actor import loop
from raytf.actor import steps as steps_lib
from raytf.actor.context import StopTraining, TaskContext
from raytf.protocol import CheckpointSaved, DrainStop, Outcome, WorkerPayload
from raytf.actor.inputs import InputPlan
from raytf.checkpoint import Storage
from raytf.spec import LEGACY_INSTALL

# What TF 2.21 raises when Keras 3's model.fit runs under MultiWorkerMirroredStrategy.
KERAS3_FIT_ERROR = "Attempt to convert a value (PerReplica"


def run(strategy: tf.distribute.Strategy, payload: WorkerPayload, ctx: TaskContext,
        own_loop: "OwnLoop | None" = None) -> Outcome:
    """Run the train_fn; `own_loop`: what is behind its ctx (default: MultiWorkerMirrored's)."""
    spec = payload.spec
    state_sync = None
    # Only replicated variables can drift apart (parameter servers hold one copy); tf-keras (Keras 2) keeps
    # BatchNormalization's statistics in sync itself.
    if backends.get(spec.strategy).replicated_variables and spec.train.keras != "legacy":
        state_sync = lambda model: steps_lib.make_state_sync(strategy, model)()  # noqa: E731
    ctx.attach(own_loop or OwnLoop(strategy, payload, ctx), state_sync)
    # train.seed: Python's, NumPy's and TensorFlow's generators, as raytf's loop seeds its own (the same on
    # every worker, so initial weights agree), so a train_fn repeats too
    random.seed(spec.train.seed)
    np.random.seed(spec.train.seed)
    tf.random.set_seed(spec.train.seed)
    try:
        payload.function("train_fn")(ctx)
        ctx.own_loop.finish()
    except StopTraining as stop:  # a drain notice: the checkpoint at the common step is written
        return Outcome(preempted=stop.info, history=ctx.history, steps=stop.info.step,
                       steps_run=stop.info.step - ctx.restored_step)
    except Exception as exc:
        if KERAS3_FIT_ERROR in str(exc):
            raise RuntimeError(
                f"{spec.train_fn}: Keras 3's model.fit fails under MultiWorkerMirroredStrategy on TensorFlow 2.21 "
                f"({KERAS3_FIT_ERROR}...) to a Tensor); run the script under tf.keras with train.keras: legacy "
                f"(tf-keras: {LEGACY_INSTALL}), or write the loop with strategy.run, or use raytf's loop "
                f"(model + data, no train_fn)") from None
        raise
    finally:
        ctx.own_loop.close()
    digest = steps_lib.weights_digest(ctx.saved_model) if ctx.saved_model is not None else None
    steps = ctx.global_step or optimizer_steps(ctx.saved_model)
    return Outcome(history=ctx.history, weights_digest=digest, steps=steps,
                   steps_run=steps - ctx.restored_step, replicas=ctx.num_replicas, exports=ctx.exports)


def optimizer_steps(model) -> int:
    """The optimizer steps of a saved model that trained without ctx.step (a Keras model.fit reports epochs
    only); 0 where the model has no optimizer."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    try:
        return int(iterations.numpy()) if iterations is not None else 0
    except Exception:  # a variable that cannot be read here says nothing about the run
        return 0


class OwnLoop:
    """The strategy, data and checkpoints behind a train_fn's ctx (which takes its numbers from here)."""

    coordinator = None  # parameter servers: the chief's ClusterCoordinator

    def __init__(self, strategy: tf.distribute.Strategy, payload: WorkerPayload, ctx: TaskContext):
        self.strategy, self.payload, self.ctx = strategy, payload, ctx
        self.per_replica_batch_size = payload.spec.train.global_batch_size // strategy.num_replicas_in_sync
        self.steps_per_epoch: int | None = None
        self.validation_steps: int | None = None
        self.restored_files: list[str] = []  # checkpoints read, kept until the loop ends (deferred restores)
        self.last_checkpoint: LoopCheckpoint | None = None  # what a drain notice saves
        self.plan_input()

    def plan_input(self) -> None:
        """The same plan as raytf's loop: shards, steps, batches (steps_per_epoch, validation_steps)."""
        self.plan = None
        if self.payload.train_data is not None:
            local_replicas = len(self.strategy.extended.worker_devices)
            self.plan = InputPlan(self.payload, self.ctx.world_size, self.per_replica_batch_size, local_replicas,
                                  cache_dir=self.ctx.staging_dir + ".cache")
            self.steps_per_epoch = self.plan.steps
            self.validation_steps = self.plan.val_steps or None

    def finish(self) -> None:
        """After the train_fn returned: what the strategy must settle before the outcome counts."""

    def close(self) -> None:
        for folder in self.restored_files:
            shutil.rmtree(folder, ignore_errors=True)

    def dataset(self, name: str, epoch: int | None, skip: int) -> tf.data.Dataset:
        context = tf.distribute.InputContext(num_input_pipelines=self.ctx.world_size,
                                             input_pipeline_id=self.ctx.rank,
                                             num_replicas_in_sync=self.strategy.num_replicas_in_sync)
        return self._input_fn(name, epoch, skip)(context)

    def distributed_dataset(self, name: str, epoch: int | None, skip: int):
        return self.strategy.distribute_datasets_from_function(self._input_fn(name, epoch, skip))

    def _input_fn(self, name: str, epoch: int | None, skip: int):
        plan, spec = self.plan, self.payload.spec
        if plan is None:
            raise ValueError("ctx.dataset: the job has no data section; give data.train (Parquet) in the job spec, "
                             "or build the dataset in the train_fn")
        if name == "validation":
            if not plan.val_steps:
                raise ValueError("ctx.dataset('validation'): the job has no data.validation; add one to the job spec")
            if epoch is not None or skip:
                raise ValueError("ctx.dataset('validation') is one whole pass: it takes no epoch or skip")
            return plan.val_input(repeat=False)
        if name != "train":
            raise ValueError(f"ctx.dataset({name!r}): the data sets are 'train' and 'validation'")
        if skip < 0 or (epoch is not None and (epoch < 1 or skip >= plan.steps)):
            raise ValueError(f"ctx.dataset('train', epoch={epoch}, skip={skip}): epoch counts from 1 and skip is "
                             f"the steps already done (0..{plan.steps - 1} within an epoch)")
        if epoch is None:  # every epoch from the one `skip` steps fall in
            first, done = skip // plan.steps + 1, skip % plan.steps
            return plan.train_input(spec.train.seed, first_epoch=first, skip_batches=done)
        endless = plan.train_input(spec.train.seed, first_epoch=epoch, skip_batches=skip)
        batches = (plan.steps - skip) * plan.local_replicas  # this worker's elements: per replica, per step

        def one_epoch(context: tf.distribute.InputContext) -> tf.data.Dataset:
            return endless(context).take(batches).apply(tf.data.experimental.assert_cardinality(batches))

        return one_epoch

    def checkpoint(self, trackables: dict[str, Any]) -> "LoopCheckpoint":
        if not trackables:
            raise ValueError("ctx.checkpoint(): name what to save, e.g. ctx.checkpoint(model=model, optimizer=optimizer)")
        self.last_checkpoint = LoopCheckpoint(tf.train.Checkpoint(**trackables), self.payload, self.ctx,
                                              self.restored_files, **self.checkpoint_settings())
        return self.last_checkpoint

    def checkpoint_settings(self) -> dict[str, Any]:
        """How this strategy's checkpoints are read and written (LoopCheckpoint's options, before_save)."""
        return {}

    def stop_here(self, step: int) -> None:
        """The step a drain notice set: save the train_fn's checkpoint here (if it made one), then end it."""
        saved, ckpt = None, self.last_checkpoint
        if ckpt is not None and ckpt.storage is not None:
            started = time.time()
            if ckpt.saved_step != step:  # the train_fn may have saved this very step itself
                ckpt.save(step)
            self.ctx.checkpoint_uploads.complete()  # the restart resumes from it: in checkpoint.dir first
            saved = CheckpointSaved(step, round(time.time() - started, 3))
        raise StopTraining(DrainStop(step, saved))


class LoopCheckpoint:
    """A train_fn's checkpoints in checkpoint.dir, written and restored as raytf's loop does its own
    (raytf.actor.loop.write_state / read_state): ckpt-<step>/ with raytf.json last, pruned to checkpoint.keep.
    Without checkpoint.dir, save() does nothing and restore() finds nothing."""

    def __init__(self, state: tf.train.Checkpoint, payload: WorkerPayload, ctx: TaskContext, restored_files: list[str],
                 options: tf.train.CheckpointOptions | None = None, before_save: Callable[[], None] | None = None):
        """options: where TensorFlow reads and writes the files (the chief's own disk, under parameter
        servers); before_save: run first (parameter servers: wait for the scheduled steps)."""
        self.state, self.payload, self.ctx = state, payload, ctx
        self.restored_files = restored_files
        self.options, self.before_save = options, before_save
        self.storage = Storage(payload.checkpoint_dir) if payload.checkpoint_dir else None
        self.saved_step: int | None = None

    def restore(self) -> int | None:
        """The optimizer step of the checkpoint this attempt resumes from (a restart, or --resume), its state
        restored into the trackables; None when the job starts fresh. The epochs reported before it come back
        too, so ctx.report goes on numbering from there."""
        resume = self.payload.resume_from
        if resume is None:
            return None
        # An optimizer has no variables before its first step: TensorFlow restores them when they are
        # created, from files that must still be there then.
        local = tempfile.mkdtemp(prefix="raytf-restore-")
        self.restored_files.append(local)
        loop.read_state(self.state, resume, self.payload.checkpoint_dir, self.ctx, self.options, keep_in=local)
        self.ctx.restored(resume.history, resume.step)
        return resume.step

    def save(self, step: int) -> None:
        """Call it on every worker at the same step (a MultiWorkerMirrored save may run collectives)."""
        if self.storage is None:
            return
        if self.before_save is not None:
            self.before_save()
        spe = self.ctx.steps_per_epoch
        epoch, in_epoch = (step // spe + 1, step % spe) if spe else (len(self.ctx.history) + 1, 0)
        history = list(self.ctx.history)
        self.saved_step = step
        loop.write_state(self.state, self.storage, self.ctx, self.payload.spec.checkpoint.keep,
                         lambda local_dir: {"step": int(step), "epoch": epoch, "step_in_epoch": in_epoch,
                                            "history": history},
                         self.options)
