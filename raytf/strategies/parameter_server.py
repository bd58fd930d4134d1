"""raytf's loop under ParameterServerStrategy: the chief coordinates, ps tasks hold the variables, workers
run the steps; and the optional evaluator side-car.

The chief (a Ray actor like every other task) builds the model under the strategy (variables go to the ps
tasks, large ones split by the variable partitioner), schedules `steps_per_epoch` steps per epoch with
`ClusterCoordinator.schedule`, and fetches each step's metric deltas in order: that is its progress, and
the sums give the epoch's metrics. A worker that dies costs nothing but its in-flight step: the
coordinator runs it again on another worker.

Keras 3 cannot take the gradient of a partitioned variable (its tf.Variable is then a ShardedVariable,
which has no handle), nor checkpoint or save one. So raytf trains the shards themselves: each shard is
wrapped in a Keras variable for the optimizer (whose slots are then placed next to the shard, on its ps
task), checkpoints hold the raw TF variables, and the saved model is a plain copy of the weights.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import tensorflow as tf
import keras
from tensorflow.python.distribute.coordinator.cluster_coordinator import PSUnavailableError
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from raytf import data
from raytf.checkpoint import META, CheckpointInfo, Storage
from raytf.errors import CheckpointCorrupt
from raytf.spec import JobSpec, PartitionerSpec
from raytf.strategies import steps as steps_lib
from raytf.worker_api import TaskContext, WorkerPayload

CHIEF_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"
WEIGHTS_FILE = "weights.npz"  # every checkpoint's full weights, for the evaluator


def partitioner(spec: JobSpec):
    part = spec.cluster.variable_partitioner or PartitionerSpec()
    if part.kind == "fixed":
        return tf.distribute.experimental.partitioners.FixedShardsPartitioner(part.shards)
    return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=part.min_shard_bytes,
                                                                       max_shards=spec.cluster.ps)


def steps_per_epoch(payload: WorkerPayload) -> int:
    spec = payload.spec
    rows = payload.train_data.num_rows
    steps = spec.train.steps_per_epoch or rows // spec.train.global_batch_size
    if steps == 0:
        raise ValueError(f"data.train has {rows} rows, fewer than one batch of {spec.train.global_batch_size}; "
                         f"lower train.global_batch_size")
    return steps


def tf_variables(variables) -> list[tf.Variable]:
    """The TF variables behind Keras variables; a partitioned one gives its shards."""
    out = []
    for v in variables:
        value = v.value
        out += list(value.variables) if isinstance(value, ShardedVariable) else [value]
    return out


def shard_targets(model: keras.Model) -> list:
    """What the optimizer trains: each trainable variable, or each shard of a partitioned one."""
    out = []
    for v in model.trainable_variables:
        if isinstance(v.value, ShardedVariable):
            out += [keras.Variable(shard, trainable=True, name=f"{v.name}_shard{i}")
                    for i, shard in enumerate(v.value.variables)]
        else:
            out.append(v)
    return out


def variable_devices(model: keras.Model) -> dict[str, list[str]]:
    return {v.path: [s.device for s in tf_variables([v])] for v in model.weights}


class _RecoveryLog(logging.Handler):
    """Catches the coordinator's "Worker ... has been recovered." (TF logs it at INFO): which lost
    workers it took back."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.recovered: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().endswith("has been recovered."):
            self.recovered.append(record.getMessage().split()[1])


def _watch_recoveries() -> _RecoveryLog:
    logger = tf.get_logger()
    # The logger must pass INFO to reach this handler; TF's own output stays at WARNING: its handler
    # is raised to WARNING and the root logger (which Ray's workers print at INFO) no longer sees it.
    for handler in logger.handlers:
        if handler.level < logging.WARNING:
            handler.setLevel(logging.WARNING)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    log = _RecoveryLog()
    logger.addHandler(log)
    return log


def run_chief(payload: WorkerPayload, ctx: TaskContext) -> dict[str, Any]:
    spec = payload.spec
    keras.utils.set_random_seed(spec.train.seed)
    recoveries = _watch_recoveries()
    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver(), variable_partitioner=partitioner(spec))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    global_batch = spec.train.global_batch_size
    model_fn = payload.function("model")
    with strategy.scope():
        model = model_fn()
        if not isinstance(model, keras.Model):
            raise TypeError(f"model: {spec.model} returned {type(model).__name__}, not a keras.Model")
        optimizer = steps_lib.build_optimizer(spec)
        targets = shard_targets(model)
        optimizer.build(targets)
    state = tf.train.Checkpoint(weights=tf_variables(model.weights), optimizer=tf_variables(optimizer.variables))
    checkpoints = _Checkpoints(state, model, payload, ctx)
    position = checkpoints.restore()
    loss_fn = steps_lib.build_loss(spec)
    train_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
    eval_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))

    info = payload.train_data
    seed = spec.train.seed + position.epoch  # a resumed run does not replay the same order
    per_worker = coordinator.create_per_worker_dataset(
        lambda: data.record_dataset(info, f"{data.RECORDS_DIR}/train", global_batch, spec.train.shuffle_buffer, seed))
    iterator = iter(per_worker)

    @tf.function
    def train_step(iterator):
        def replica(x, y):
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                y = steps_lib.align_labels(y, pred)
                per_example = loss_fn(y, pred)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            grads = tape.gradient(loss, [t.value for t in targets])
            optimizer.apply_gradients(zip(grads, targets))
            return train_acc.delta(y, pred, per_example)

        x, y = next(iterator)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica, args=(x, y)), axis=None)

    @tf.function
    def eval_step(x, y, w):  # on the chief itself: exact, every validation row once
        pred = model(x, training=False)
        y = steps_lib.align_labels(y, pred)
        return eval_acc.delta(y, pred, loss_fn(y, pred), weight=w)

    validate = _validation(payload, global_batch) if not spec.cluster.evaluator else None
    in_flight = IN_FLIGHT_PER_WORKER * spec.cluster.workers
    steps = steps_per_epoch(payload)
    writer = steps_lib.summary_writer(ctx) if spec.output.tensorboard else None
    history = list(position.history)
    global_step = position.global_step
    every_kind, every = spec.checkpoint.interval
    for epoch in range(position.epoch, spec.train.epochs + 1):
        started = time.time()
        resuming = epoch == position.epoch and position.step_in_epoch > 0
        totals = np.array(position.totals, np.float64) if resuming and position.totals else \
            np.zeros(sum(train_acc.sizes), np.float64)
        step = position.step_in_epoch if epoch == position.epoch else 0
        unreported = 0  # steps whose metrics died with their worker
        while step < steps:
            stop = steps  # the next checkpoint, or the epoch's end
            if every_kind == "steps":
                stop = min(steps, step + every - global_step % every)
            for delta in _run_steps(coordinator, train_step, iterator, stop - step, in_flight):
                step += 1
                global_step += 1
                if delta is None:
                    unreported += 1
                    continue
                totals += delta
                ctx.step(epoch, step, steps, global_step, delta[0] / max(delta[1], 1.0), global_batch)
            if every_kind == "steps" and global_step % every == 0 and step < steps:
                checkpoints.save(global_step, epoch, step, history, totals)
        coordinator.join()
        metrics = train_acc.results(totals)
        if unreported:
            metrics["steps_unreported"] = unreported
        val = None
        if validate is not None:
            ctx.phase("validating")
            val = eval_acc.results(validate(eval_step))
        steps_lib.end_epoch(ctx, writer, history, metrics, val, epoch, started, global_step)
        final_for_evaluator = epoch == spec.train.epochs and spec.cluster.evaluator  # it must see the final weights
        if steps_lib.checkpoint_due(spec.checkpoint.interval, global_step, epoch) or final_for_evaluator:
            checkpoints.save(global_step, epoch + 1, 0, history)

    weights = model.get_weights()
    plain = model_fn()  # outside the strategy: ordinary variables on the chief, which Keras can save
    plain.set_weights(weights)
    plain.save(os.path.join(ctx.staging_dir, "model.keras"))
    return {"history": history, "weights_digest": steps_lib.weights_digest(plain), "steps": global_step,
            "steps_run": global_step - position.global_step, "replicas": strategy.num_replicas_in_sync,
            "variable_devices": variable_devices(model), "recovered_workers": recoveries.recovered}


IN_FLIGHT_PER_WORKER = 4  # scheduled steps not yet fetched, per worker: enough to keep every worker busy


def _run_steps(coordinator, train_step, iterator, count: int, in_flight: int):
    """Yield the metric deltas of `count` train steps, in order, with at most `in_flight` scheduled and
    not yet fetched. Fetching the oldest first is the progress; the window keeps a step that a dead
    worker gave back (TF re-queues it at the end) from waiting behind a whole epoch of others."""
    scheduled = collections.deque()
    for _ in range(min(count, in_flight)):
        scheduled.append(coordinator.schedule(train_step, args=(iterator,)))
    left = count - len(scheduled)
    while scheduled:
        delta = _fetch(scheduled.popleft())
        if left > 0:
            scheduled.append(coordinator.schedule(train_step, args=(iterator,)))
            left -= 1
        yield delta


def _fetch(remote):
    """A step's metric deltas; None when the step ran but the worker holding its result died before the
    chief copied it (the update is on the ps tasks; only the step's metrics are lost). A step that failed
    raises its error, a ps task's failure included."""
    try:
        return remote.fetch()
    except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError) as exc:
        if isinstance(exc, PSUnavailableError) or "/job:ps" in str(exc):
            raise
        return None


def _validation(payload: WorkerPayload, batch: int):
    """A function running eval_step over every validation row once, on the chief; returns the sums."""
    if payload.val_data is None:
        return None
    info = payload.val_data
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    steps = max(1, math.ceil(info.num_rows / batch))
    with tf.device(CHIEF_DEVICE):
        dataset = data.eval_dataset(info, payload.val_root, shard, batch, steps, repeat=True)
        iterator = iter(dataset)

    def validate(eval_step) -> np.ndarray:
        total = None
        for _ in range(steps):
            delta = eval_step(*next(iterator)).numpy()
            total = delta if total is None else total + delta
        return total

    return validate


class _Checkpoints:
    """The raw TF variables (shards as they are) through tf.train.Checkpoint, all written by the chief
    (TF would otherwise write each variable's part on its ps host), plus the full weights as NumPy for
    the evaluator; uploaded with the position through raytf.checkpoint.Storage."""

    def __init__(self, state: tf.train.Checkpoint, model: keras.Model, payload: WorkerPayload, ctx: TaskContext):
        self.state, self.model, self.payload, self.ctx = state, model, payload, ctx
        # Shard shapes per variable: a checkpoint only fits the same ps count and partitioner.
        self.layout = {v.path: [s.shape.as_list() for s in tf_variables([v])] for v in model.weights}
        self.options = tf.train.CheckpointOptions(experimental_io_device=CHIEF_DEVICE)
        self.storage = Storage(payload.checkpoint_dir) if payload.checkpoint_dir else None

    def restore(self) -> steps_lib.Position:
        resume = self.payload.resume_from
        if resume is None:
            return steps_lib.Position()
        self.ctx.phase("restoring")
        local = tempfile.mkdtemp(prefix="raytf-restore-")
        try:
            try:
                Storage(self.payload.checkpoint_dir).download(resume, local)
                with open(os.path.join(local, META)) as f:
                    meta = json.load(f)
            except Exception as exc:
                raise CheckpointCorrupt(resume.path, _first_line(exc)) from None
            saved = meta.get("layout")
            if saved is not None and saved != self.layout:
                changed = sorted(k for k in set(saved) | set(self.layout) if saved.get(k) != self.layout.get(k))
                raise ValueError(
                    f"checkpoint {resume.path} holds variables split differently from this job's ({changed[0]}: "
                    f"{saved.get(changed[0])} there, {self.layout.get(changed[0])} here); keep cluster.ps and "
                    f"cluster.variable_partitioner as they were for that run, or use a fresh checkpoint.dir")
            try:
                self.state.read(os.path.join(local, "state"), options=self.options).assert_existing_objects_matched()
            except Exception as exc:
                raise CheckpointCorrupt(resume.path, _first_line(exc)) from None
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return steps_lib.Position(resume.epoch, resume.step_in_epoch, resume.step, resume.history, meta.get("epoch_totals"))

    def save(self, global_step: int, epoch: int, step_in_epoch: int, history: list, totals=None) -> None:
        if self.storage is None:
            return
        self.ctx.phase("checkpointing")
        local = tempfile.mkdtemp(prefix="raytf-ckpt-")
        try:
            self.state.write(os.path.join(local, "state"), options=self.options)
            np.savez(os.path.join(local, WEIGHTS_FILE), *self.model.get_weights())
            self.storage.upload(local, {"step": global_step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                                        "history": history, "world_size": self.ctx.world_size,
                                        "saved_at": time.time(), "layout": self.layout,
                                        "epoch_totals": totals.tolist() if totals is not None else None})
            self.storage.prune(self.payload.spec.checkpoint.keep)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.ctx.phase("train")


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


# ---------------------------------------------------------------- the evaluator side-car

EVALUATOR_POLL_S = 0.5


def run_evaluator(payload: WorkerPayload, ctx: TaskContext) -> dict[str, Any]:
    """Evaluate the latest checkpoint on the validation data whenever a new one appears (one that
    appears while another is evaluated waits; older ones are skipped), until the final step's. Reports
    val_* metrics per checkpoint; the chief never waits for it."""
    spec = payload.spec
    model = payload.function("model")()
    loss_fn = steps_lib.build_loss(spec)
    acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
    info = payload.val_data
    batch = spec.train.global_batch_size
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    val_steps = max(1, math.ceil(info.num_rows / batch))
    iterator = iter(data.eval_dataset(info, payload.val_root, shard, batch, val_steps, repeat=True))

    @tf.function
    def eval_step(x, y, w):
        pred = model(x, training=False)
        y = steps_lib.align_labels(y, pred)
        return acc.delta(y, pred, loss_fn(y, pred), weight=w)

    storage = Storage(payload.checkpoint_dir)
    final_step = spec.train.epochs * steps_per_epoch(payload)
    evaluated: list[dict[str, Any]] = []
    last_step = payload.resume_from.step if payload.resume_from else -1
    ctx.phase("waiting for a checkpoint")
    while last_step < final_step:
        latest = storage.latest()
        if latest is None or latest.step <= last_step:
            time.sleep(EVALUATOR_POLL_S)
            ctx.phase("waiting for a checkpoint")
            continue
        ctx.phase("evaluating")
        try:
            weights = _load_weights(storage, latest)
        except (OSError, KeyError, ValueError):  # pruned by the chief meanwhile: take the next latest
            time.sleep(EVALUATOR_POLL_S)
            continue
        model.set_weights(weights)
        total = None
        for _ in range(val_steps):
            delta = eval_step(*next(iterator)).numpy()
            total = delta if total is None else total + delta
        val = acc.results(total)
        entry = {"step": latest.step, **{f"val_{k}": v for k, v in val.items() if k != "examples"},
                 "val_examples": val["examples"]}
        if latest.step_in_epoch == 0:  # written at the end of epoch latest.epoch - 1
            entry["epoch"] = latest.epoch - 1
        evaluated.append(entry)
        ctx.evaluation(entry)
        last_step = latest.step
    return {"evaluations": evaluated, "history": [], "steps": last_step}


def _load_weights(storage: Storage, checkpoint: CheckpointInfo) -> list[np.ndarray]:
    local = tempfile.mkdtemp(prefix="raytf-eval-")
    try:
        storage.download(checkpoint, local)
        with np.load(os.path.join(local, WEIGHTS_FILE)) as saved:
            return [saved[f"arr_{i}"] for i in range(len(saved.files))]
    finally:
        shutil.rmtree(local, ignore_errors=True)
