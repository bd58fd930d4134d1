"""raytf's training loop under MultiWorkerMirroredStrategy (Keras 3 `model.fit` fails under it on TF 2.21).

Runs inside every worker actor, after TF_CONFIG is set and the strategy is built. All workers execute
the same number of steps per epoch (planned from Parquet metadata, or train.steps_per_epoch), which is
what keeps the collectives from hanging; metrics are all-reduced once per epoch.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any

import tensorflow as tf
import keras

from raytf import data
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
    with strategy.scope():
        model = model_fn()
        if not isinstance(model, keras.Model):
            raise TypeError(f"model: {spec.model} returned {type(model).__name__}, not a keras.Model")
        optimizer = steps_lib.build_optimizer(spec)
    loss_fn = steps_lib.build_loss(spec)
    train_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
    eval_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
    fns = steps_lib.make_step_functions(strategy, model, optimizer, loss_fn, train_acc, eval_acc, global_batch)

    plan = _Plan(payload, ctx.world_size, global_batch, per_replica, local_replicas)
    writer = _summary_writer(ctx) if ctx.is_chief and spec.output.tensorboard else None

    # One iterator for all epochs (building a distributed pipeline costs ~0.1 s; an epoch of a small
    # job may be shorter than that).
    if spec.dataset_fn is not None:
        iterator = iter(strategy.distribute_datasets_from_function(payload.function("dataset_fn")))
    else:
        iterator = iter(strategy.distribute_datasets_from_function(plan.train_input(spec.train.seed)))
    val_iterator = iter(strategy.distribute_datasets_from_function(plan.val_input())) if plan.val_steps else None

    history = []
    global_step = 0
    for epoch in range(1, spec.train.epochs + 1):
        started = time.time()
        train_acc.total.assign(tf.zeros_like(train_acc.total))
        for step in range(1, plan.steps + 1):
            try:
                loss = fns.train(iterator)
            except tf.errors.OutOfRangeError:
                raise ValueError(f"dataset_fn's dataset ended after {step - 1} steps of epoch {epoch}; "
                                 f"make it longer (e.g. .repeat()) or lower train.steps_per_epoch") from None
            global_step += 1
            ctx.step(epoch, step, plan.steps, global_step, loss, global_batch)
        metrics = train_acc.results(fns.global_sum(train_acc.total.read_value()).numpy())
        if plan.val_steps:
            eval_acc.total.assign(tf.zeros_like(eval_acc.total))
            for _ in range(plan.val_steps):
                fns.evaluate(val_iterator)
            val = eval_acc.results(fns.global_sum(eval_acc.total.read_value()).numpy())
            metrics.update({f"val_{k}": v for k, v in val.items() if k != "examples"})
            metrics["val_examples"] = val["examples"]
        metrics.update(epoch=epoch, seconds=round(time.time() - started, 3), step=global_step)
        history.append(metrics)
        ctx.epoch_end(metrics)
        if writer is not None:
            with writer.as_default(step=epoch):
                for k, v in metrics.items():
                    if k not in ("epoch", "step") and isinstance(v, float):
                        tf.summary.scalar(k, v)
            writer.flush()

    if ctx.is_chief:
        model.save(os.path.join(ctx.staging_dir, "model.keras"))
    return {"history": history, "weights_digest": steps_lib.weights_digest(model), "steps": global_step,
            "replicas": replicas}


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

    def train_input(self, seed: int):
        p = self.payload

        def dataset_fn(input_context: tf.distribute.InputContext):
            shard = self.train_shards[input_context.input_pipeline_id]
            return data.train_dataset(p.train_data, p.train_root, shard, self.per_replica,
                                      self.steps * self.local_replicas, self.shuffle_buffer, seed, pad=self.pad)

        return dataset_fn

    def val_input(self):
        p = self.payload

        def dataset_fn(input_context: tf.distribute.InputContext):
            shard = self.val_shards[input_context.input_pipeline_id]
            return data.eval_dataset(p.val_data, p.val_root, shard, self.per_replica,
                                     self.val_steps * self.local_replicas, repeat=True)

        return dataset_fn


def _summary_writer(ctx: TaskContext):
    return tf.summary.create_file_writer(os.path.join(ctx.staging_dir, "tensorboard"))


def _run_user_loop(strategy, payload: WorkerPayload, ctx: TaskContext) -> dict[str, Any]:
    """train_fn: the user's loop; raytf gives it the strategy, rank, batch sizes and report()."""
    ctx.strategy = strategy
    ctx.num_replicas = strategy.num_replicas_in_sync
    ctx.per_replica_batch_size = payload.spec.train.global_batch_size // ctx.num_replicas
    payload.function("train_fn")(ctx)
    digest = steps_lib.weights_digest(ctx.saved_model) if ctx.saved_model is not None else None
    return {"history": ctx.history, "weights_digest": digest, "steps": ctx.global_step,
            "replicas": ctx.num_replicas}
