"""raytf's training loop under MultiWorkerMirroredStrategy (Keras 3 `model.fit` fails under it on TF 2.21).

Runs inside every worker actor, after TF_CONFIG is set and the strategy is built. All workers execute
the same number of steps per epoch (planned from Parquet metadata, or train.steps_per_epoch), which is
what keeps the collectives from hanging; metrics are all-reduced once per epoch.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from typing import Any

import tensorflow as tf
import keras

from raytf import data
from raytf.checkpoint import Storage
from raytf.errors import CheckpointCorrupt
from raytf.strategies import steps as steps_lib
from raytf.worker_api import TaskContext, WorkerPayload


def run(strategy: tf.distribute.Strategy, payload: WorkerPayload, ctx: TaskContext) -> dict[str, Any]:
    spec = payload.spec
    if spec.train_fn is not None:
        return _run_user_loop(strategy, payload, ctx)

    keras.utils.set_random_seed(spec.train.seed)
    replicas = strategy.num_replicas_in_sync
    local_replicas = len(strategy.extended.worker_devices)
    global_batch = spec.train.global_batch_size
    if global_batch % replicas:
        raise ValueError(f"train.global_batch_size {global_batch} is not divisible by the {replicas} replicas "
                         f"TensorFlow found ({local_replicas} per worker)")
    per_replica = global_batch // replicas

    model_fn = payload.function("model")
    keras.mixed_precision.set_global_policy(spec.train.precision)
    with strategy.scope():
        model = model_fn()
        if not isinstance(model, keras.Model):
            raise TypeError(f"model: {spec.model} returned {type(model).__name__}, not a keras.Model")
        optimizer = steps_lib.build_optimizer(spec)
        optimizer.build(model.trainable_variables)  # slots exist before a restore fills them
    checkpoints = Checkpointer(model, optimizer, payload, ctx)
    position = checkpoints.restore()  # (epoch, step in epoch, global step, history) to start from
    loss_fn = steps_lib.build_loss(spec)
    train_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
    eval_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
    fns = steps_lib.make_step_functions(strategy, model, optimizer, loss_fn, train_acc, eval_acc, global_batch,
                                        jit_compile=spec.train.jit_compile)

    plan = _Plan(payload, ctx.world_size, global_batch, per_replica, local_replicas)
    writer = steps_lib.summary_writer(ctx) if ctx.is_chief and spec.output.tensorboard else None

    # One iterator for all epochs (building a distributed pipeline costs ~0.1 s; an epoch of a small
    # job may be shorter than that).
    if spec.dataset_fn is not None:
        iterator = iter(strategy.distribute_datasets_from_function(payload.function("dataset_fn")))
    else:
        iterator = iter(strategy.distribute_datasets_from_function(
            plan.train_input(spec.train.seed, first_epoch=position.epoch, skip_batches=position.step_in_epoch)))
    val_iterator = iter(strategy.distribute_datasets_from_function(plan.val_input())) if plan.val_steps else None

    history = list(position.history)
    global_step = position.global_step
    every_kind, every = spec.checkpoint.interval
    for epoch in range(position.epoch, spec.train.epochs + 1):
        started = time.time()
        train_acc.total.assign(tf.zeros_like(train_acc.total))
        first_step = position.step_in_epoch + 1 if epoch == position.epoch else 1
        for step in range(first_step, plan.steps + 1):
            try:
                loss = fns.train(iterator)
            except tf.errors.OutOfRangeError:
                raise ValueError(f"dataset_fn's dataset ended after {step - 1} steps of epoch {epoch}; "
                                 f"make it longer (e.g. .repeat()) or lower train.steps_per_epoch") from None
            global_step += 1
            ctx.step(epoch, step, plan.steps, global_step, loss, global_batch)
            if every_kind == "steps" and global_step % every == 0 and step < plan.steps:
                fns.sync_state()
                checkpoints.save(global_step, epoch, step, history)
        fns.sync_state()  # before validation: every worker evaluates, and ends with, the same model
        metrics = train_acc.results(fns.global_sum(train_acc.total.read_value()).numpy())
        val = None
        if plan.val_steps:
            ctx.phase("validating")
            eval_acc.total.assign(tf.zeros_like(eval_acc.total))
            for _ in range(plan.val_steps):
                fns.evaluate(val_iterator)
            val = eval_acc.results(fns.global_sum(eval_acc.total.read_value()).numpy())
        steps_lib.end_epoch(ctx, writer, history, metrics, val, epoch, started, global_step)
        if steps_lib.checkpoint_due(spec.checkpoint.interval, global_step, epoch):
            checkpoints.save(global_step, epoch + 1, 0, history)

    if ctx.is_chief:
        model.save(os.path.join(ctx.staging_dir, "model.keras"))
    return {"history": history, "weights_digest": steps_lib.weights_digest(model), "steps": global_step,
            "steps_run": global_step - position.global_step, "replicas": replicas,
            "optimizer_steps": int(optimizer.iterations.numpy())}


class _Plan:
    """Steps per epoch and the per-worker input functions, from the Parquet metadata."""

    def __init__(self, payload: WorkerPayload, world_size: int, global_batch: int, per_replica: int,
                 local_replicas: int):
        spec = payload.spec
        self.payload, self.per_replica, self.local_replicas = payload, per_replica, local_replicas
        self.shuffle_buffer = spec.train.shuffle_buffer
        per_worker = per_replica * local_replicas
        if payload.train_data is None:  # dataset_fn: the user's pipeline, the spec's step count
            self.steps, self.val_steps = spec.train.steps_per_epoch, 0
            return
        rows = payload.train_data.num_rows
        self.train_shards = data.plan_shards([p.num_rows for p in payload.train_data.pieces], world_size)
        self.pad = spec.data.remainder == "pad"
        full = rows // global_batch
        if self.pad:  # every row once per epoch: enough batches for the largest shard, padded
            full = math.ceil(max(data.shard_rows(s) for s in self.train_shards) / per_worker)
        if full == 0 and spec.train.steps_per_epoch is None:
            raise ValueError(f"data.train has {rows} rows, fewer than one global batch of {global_batch}; "
                             f"lower train.global_batch_size or use data.remainder: pad")
        self.steps = spec.train.steps_per_epoch or full
        self.val_steps = 0
        if payload.val_data is not None:
            self.val_shards = data.plan_shards([p.num_rows for p in payload.val_data.pieces], world_size)
            largest = max(data.shard_rows(s) for s in self.val_shards)
            self.val_steps = max(1, math.ceil(largest / per_worker))

    def train_input(self, seed: int, first_epoch: int = 1, skip_batches: int = 0):
        """From `first_epoch`, less the batches of it already trained (a resume from mid-epoch)."""
        p = self.payload

        def dataset_fn(input_context: tf.distribute.InputContext):
            shard = self.train_shards[input_context.input_pipeline_id]
            ds = data.train_dataset(p.train_data, p.train_root, shard, self.per_replica,
                                    self.steps * self.local_replicas, self.shuffle_buffer, seed,
                                    first_epoch=first_epoch, pad=self.pad)
            return ds.skip(skip_batches * self.local_replicas) if skip_batches else ds

        return dataset_fn

    def val_input(self):
        p = self.payload

        def dataset_fn(input_context: tf.distribute.InputContext):
            shard = self.val_shards[input_context.input_pipeline_id]
            return data.eval_dataset(p.val_data, p.val_root, shard, self.per_replica,
                                     self.val_steps * self.local_replicas, repeat=True)

        return dataset_fn


class Checkpointer:
    """Model + optimizer state (with its step counter) through tf.train.Checkpoint. Every worker writes
    (a MultiWorkerMirrored save may run collectives), each to its own temporary folder; the chief
    uploads its copy with the position and history, then prunes to checkpoint.keep."""

    def __init__(self, model, optimizer, payload: WorkerPayload, ctx: TaskContext):
        self.ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
        self.payload, self.ctx = payload, ctx
        self.storage = Storage(payload.checkpoint_dir) if payload.checkpoint_dir else None

    def restore(self) -> steps_lib.Position:
        resume = self.payload.resume_from
        if resume is None:
            return steps_lib.Position()
        self.ctx.phase("restoring")
        local = tempfile.mkdtemp(prefix="raytf-restore-")
        try:
            Storage(self.payload.checkpoint_dir).download(resume, local)
            self.ckpt.read(os.path.join(local, "state")).assert_existing_objects_matched()
        except Exception as exc:
            raise CheckpointCorrupt(resume.path, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return steps_lib.Position(resume.epoch, resume.step_in_epoch, resume.step, resume.history)

    def save(self, global_step: int, epoch: int, step_in_epoch: int, history: list) -> None:
        if self.storage is None:
            return
        self.ctx.phase("checkpointing")
        local = tempfile.mkdtemp(prefix="raytf-ckpt-")
        try:
            self.ckpt.write(os.path.join(local, "state"))
            if self.ctx.is_chief:
                self.storage.upload(local, {"step": global_step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                                            "history": history, "world_size": self.ctx.world_size,
                                            "saved_at": time.time()})
                self.storage.prune(self.payload.spec.checkpoint.keep)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.ctx.phase("train")


def _run_user_loop(strategy, payload: WorkerPayload, ctx: TaskContext) -> dict[str, Any]:
    """train_fn: the user's loop; raytf gives it the strategy, rank, batch sizes and report()."""
    ctx.strategy = strategy
    ctx.num_replicas = strategy.num_replicas_in_sync
    ctx.per_replica_batch_size = payload.spec.train.global_batch_size // ctx.num_replicas
    ctx.state_sync = lambda model: steps_lib.make_state_sync(strategy, model)()
    payload.function("train_fn")(ctx)
    digest = steps_lib.weights_digest(ctx.saved_model) if ctx.saved_model is not None else None
    return {"history": ctx.history, "weights_digest": digest, "steps": ctx.global_step,
            "steps_run": ctx.global_step, "replicas": ctx.num_replicas}
