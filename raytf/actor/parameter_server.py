"""raytf's loop under ParameterServerStrategy: the chief coordinates, ps tasks hold the variables, workers
run the steps; and the optional evaluator side-car. (A train_fn runs on the chief instead of this loop:
raytf.actor.ps_own_loop; the ps and worker tasks are the same.)

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
import inspect
import math
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Iterator

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute.coordinator.cluster_coordinator import (
    PSUnavailableError,
)
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from raytf import data
from raytf.actor import export, loop, pipelines
from raytf.actor import inputs, ps_own_loop
from raytf.actor.ps_common import CHIEF_DEVICE, WORKER_INDEX_FILE, partitioner, watch_recoveries
from raytf.actor import steps as steps_lib
from raytf.actor.context import TaskContext
from raytf.protocol import Outcome, WorkerPayload
from raytf.actor.examples import Examples
from raytf.checkpoint import CheckpointInfo, Storage
from raytf.errors import RaytfError

WEIGHTS_FILE = "weights.npz"  # every checkpoint's full weights, for the evaluator


def steps_per_epoch(payload: WorkerPayload) -> int:
    if payload.train_data is None:  # dataset_fn: the spec requires train.steps_per_epoch
        return payload.spec.train.steps_per_epoch
    return inputs.steps_per_epoch(payload.spec, payload.train_data.num_rows)


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


# ---------------------------------------------------------------- the actor's half of the backend


def prepare(task, payload: WorkerPayload, ctx: TaskContext) -> None:
    """A worker's shard of the training data as local TFRecords (see raytf.actor.pipelines), and its staging
    folder as the working directory: the pipeline the chief builds reads them by a relative path, with TF ops
    only (a pipeline that calls back into Python cannot run on a remote TF worker). Without data (a
    dataset_fn, or a train_fn that reads its own), the working directory stays the job's."""
    if task.role != "worker" or payload.train_data is None:
        return
    ctx.channel.phase("converting data")
    info = payload.train_data
    shard = data.plan_shards([p.num_rows for p in info.pieces], payload.spec.cluster.workers)[task.index]
    try:
        pipelines.write_records(info, payload.train_root, shard,
                                os.path.join(ctx.staging_dir, pipelines.RECORDS_DIR, "train"))
    except ValueError as exc:
        raise ValueError(f"worker {task.index}: {exc}") from None
    with open(os.path.join(ctx.staging_dir, WORKER_INDEX_FILE), "w") as f:
        f.write(str(task.index))  # read by the worker's own pipeline: which worker ran a scheduled step
    os.chdir(ctx.staging_dir)


def start(task, payload: WorkerPayload, ctx: TaskContext):
    """ps and worker tasks run TF's server, alive as long as the actor; the chief's strategy connects to
    them in `train`, and the evaluator only reads checkpoints."""
    if task.role in ("chief", "evaluator"):
        return None
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return tf.distribute.Server(resolver.cluster_spec(), job_name=task.role, task_index=task.index,
                                protocol="grpc", start=True)


def train(server, task, payload: WorkerPayload, ctx: TaskContext) -> Outcome:
    if server is not None:  # ps and workers serve the chief until the controller stops them
        ctx.channel.phase("serving")
        threading.Event().wait()
    return run_chief(payload, ctx) if task.role == "chief" else run_evaluator(payload, ctx)


def run_chief(payload: WorkerPayload, ctx: TaskContext) -> Outcome:
    if payload.spec.train_fn is not None:
        return ps_own_loop.run(payload, ctx)
    return loop.run(ParameterServerRunner(payload, ctx), payload, ctx)


class ParameterServerRunner:
    """raytf's loop on the chief: steps scheduled with ClusterCoordinator onto whichever worker is free,
    their metric deltas fetched in order (the progress, and the epoch's sums); validation on the chief."""

    rescuable = False  # the variables live on the parameter servers, not here
    own_timing = False  # raytf.actor.loop.Runner

    def __init__(self, payload: WorkerPayload, ctx: TaskContext):
        spec = payload.spec
        self.payload, self.ctx = payload, ctx
        keras.utils.set_random_seed(spec.train.seed)
        self.recoveries = watch_recoveries()
        self.strategy = strategy = tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.TFConfigClusterResolver(), variable_partitioner=partitioner(spec))
        self.coordinator = coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        global_batch = spec.train.global_batch_size
        self.steps = steps_per_epoch(payload)
        model, optimizer, targets = steps_lib.build_model(payload, strategy, self.steps, trained=shard_targets)
        self.model, self.optimizer = model, optimizer
        self.state = tf.train.Checkpoint(weights=tf_variables(model.weights),
                                         optimizer=tf_variables(optimizer.variables))
        # Shard shapes per variable: a checkpoint only fits the same ps count and partitioner.
        self.layout = {v.path: [s.shape.as_list() for s in tf_variables([v])] for v in model.weights}
        loss_fn = steps_lib.build_loss(spec)
        self.train_acc = train_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
        self.eval_acc = eval_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))

        info = payload.train_data
        first_epoch = payload.resume_from.epoch if payload.resume_from else 1
        seed = spec.train.seed + first_epoch  # a resumed run does not replay the same order
        # data.decode/preprocess/cache: traced here, on the chief, and run as a graph on each worker
        examples = Examples(payload, info, training=True) if spec.data is not None and spec.data.per_example else None

        def worker_dataset():
            if info is None:  # dataset_fn: which worker ran a step is not known (-1: no per-worker timing)
                batches = user_batches(payload.function("dataset_fn"), spec.train.accumulation_steps)
                return tf.data.Dataset.zip((batches, tf.data.Dataset.from_tensors(-1).repeat()))
            # Runs on each worker: its own index file, so every step says which worker ran it.
            index = tf.strings.to_number(tf.io.read_file(WORKER_INDEX_FILE), tf.int32)
            batches = pipelines.record_dataset(info, f"{pipelines.RECORDS_DIR}/train", global_batch,
                                               spec.train.shuffle_buffer, seed,
                                               micro_batches=spec.train.accumulation_steps, examples=examples,
                                               worker=index)
            return tf.data.Dataset.zip((batches, tf.data.Dataset.from_tensors(index).repeat()))

        per_worker = coordinator.create_per_worker_dataset(worker_dataset)
        self._iterator = iter(per_worker)

        sources = [t.value for t in targets]
        gradients = steps_lib.make_gradients(model, optimizer, loss_fn, train_acc, spec.train.effective_batch_size,
                                             sources, micro_batches=spec.train.accumulation_steps)
        # One scheduled step is one optimizer step: its worker runs the K micro-batches, then applies once.
        gradients = steps_lib.accumulate(gradients, sources, sum(train_acc.sizes), spec.train.accumulation_steps,
                                         take=lambda t, k: t[:, k])

        timed = spec.output.timing

        @steps_lib.step_function
        def train_step(iterator):
            def replica(x, y):
                grads, delta = gradients(x, y)
                optimizer.apply_gradients(zip(grads, targets))  # unscales under loss scaling
                return delta

            began = tf.timestamp()
            with tf.control_dependencies([began] if timed else []):
                (x, y), worker = next(iterator)
            fed = steps_lib.StepTiming.fed((x, y)) if timed else began
            delta = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica, args=(x, y)), axis=None)
            with tf.control_dependencies([delta] if timed else []):  # the worker's forward and backward pass
                done = tf.timestamp()
            return delta, tf.stack([fed - began, done - fed]), worker

        @steps_lib.step_function
        def eval_step(x, y, w):  # on the chief itself: exact, every validation row once
            pred = steps_lib.float32(model(x, training=False))
            y = steps_lib.align_labels(y, pred)
            return eval_acc.delta(y, pred, loss_fn(y, pred), weight=w,
                                  regularization=steps_lib.regularization_loss(model))

        self._train_step, self._eval_step = train_step, eval_step
        self._validate = _validation(payload, global_batch, ctx.staging_dir + ".cache") \
            if not spec.cluster.evaluator else None
        self.validates = self._validate is not None
        self._in_flight = IN_FLIGHT_PER_WORKER * spec.cluster.workers
        self._totals = np.zeros(sum(train_acc.sizes), np.float64)
        self._unreported = 0  # steps whose metrics died with their worker
        self._timing = np.zeros((spec.cluster.workers, 3))  # per worker: input wait s, step s, steps
        self._timed_workers: set[int] = set()

    def start_epoch(self, epoch: int, totals: np.ndarray | None) -> None:
        self._totals = totals.copy() if totals is not None else np.zeros(sum(self.train_acc.sizes), np.float64)
        self._unreported = 0

    def train(self, count: int, epoch: int, stopping=lambda: False) -> Iterator[Any]:
        for fetched in _run_steps(self.coordinator, self._train_step, self._iterator, count, self._in_flight,
                                  stopping):
            if fetched is None:
                self._unreported += 1
                yield None
                continue
            delta, (wait, step), worker = fetched
            self._totals += delta
            worker = int(worker)
            if worker >= 0:  # -1: a dataset_fn's step, whose worker is not known
                if worker in self._timed_workers:  # a worker's first step is its pipeline starting up
                    self._timing[worker] += (wait, step, 1.0)
                self._timed_workers.add(worker)
            yield delta[0] / max(delta[1], 1.0)

    def timing(self) -> dict[str, dict[str, float]]:
        """Each worker's input wait and step time, from the steps it ran (their fetched results)."""
        if not self.payload.spec.output.timing:
            return {}
        rows = self.payload.spec.train.effective_batch_size  # a step runs on one worker
        return {f"worker-{i}": steps_lib.timing_totals(sums, rows) for i, sums in enumerate(self._timing) if sums[2]}

    def epoch_totals(self) -> np.ndarray:
        self.coordinator.join()
        return self._totals.copy()

    def epoch_notes(self) -> dict[str, Any]:
        return {"steps_unreported": self._unreported} if self._unreported else {}

    def sync_state(self) -> None:
        pass  # one copy of every variable, on the ps tasks

    def validate(self) -> np.ndarray:
        return self._validate(self._eval_step)

    def checkpoint_options(self) -> tf.train.CheckpointOptions:
        # All written by the chief (TF would otherwise write each variable's part on its ps host).
        return tf.train.CheckpointOptions(experimental_io_device=CHIEF_DEVICE)

    def checkpoint_extras(self, local_dir: str) -> dict[str, Any]:
        """The full weights as NumPy too, for the evaluator; and the shard layout, checked on restore."""
        np.savez(os.path.join(local_dir, WEIGHTS_FILE), *self.model.get_weights())
        return {"layout": self.layout}

    def check_restorable(self, meta: dict[str, Any], path: str) -> None:
        saved = meta.get("layout")
        if saved is not None and saved != self.layout:
            changed = sorted(k for k in set(saved) | set(self.layout) if saved.get(k) != self.layout.get(k))
            raise ValueError(
                f"checkpoint {path} holds variables split differently from this job's ({changed[0]}: "
                f"{saved.get(changed[0])} there, {self.layout.get(changed[0])} here); keep cluster.ps and "
                f"cluster.variable_partitioner as they were for that run, or use a fresh checkpoint.dir")

    def final_checkpoint_needed(self) -> bool:
        return self.payload.spec.cluster.evaluator  # the evaluator must see the final weights

    def finish(self) -> Outcome:
        plain = plain_model(self.payload, self.model.get_weights())
        exports = export.write(plain, self.payload, self.ctx.staging_dir, plain=True)
        return Outcome(exports=exports, weights_digest=steps_lib.weights_digest(plain),
                       replicas=self.strategy.num_replicas_in_sync, variable_devices=variable_devices(self.model),
                       recovered_workers=self.recoveries.recovered)


def plain_model(payload: WorkerPayload, weights: list) -> keras.Model:
    """The trained model outside the strategy: ordinary variables on the chief (a subclassed model built
    first, on a row of the data; a dataset_fn's model has its variables from the start, steps_lib says)."""
    if payload.train_data is None:
        model = payload.function("model")()
        model.set_weights(weights)
        return model
    return export.plain_copy(payload.function("model"), weights, payload)


def user_batches(dataset_fn, micro_batches: int) -> tf.data.Dataset:
    """A dataset_fn's dataset on a worker. It is called as under mirrored, with an InputContext (one input
    pipeline: every worker runs the same function, and a step takes one batch of train.global_batch_size
    from one worker), or with nothing when it takes no argument (as create_per_worker_dataset's functions).
    With train.accumulation_steps K, K batches make one element, batch-major ([batch, K, ...]) as raytf's
    records are."""
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
    takes_context = bool(inspect.signature(dataset_fn).parameters)
    batches = dataset_fn(context) if takes_context else dataset_fn()
    if micro_batches == 1:
        return batches

    def batch_major(*element):  # (x, y) arrives as two arguments, a lone element as one
        return tf.nest.map_structure(lambda t: tf.experimental.numpy.swapaxes(t, 0, 1),
                                     element if len(element) > 1 else element[0])

    return batches.batch(micro_batches, drop_remainder=True).map(batch_major)


IN_FLIGHT_PER_WORKER = 4  # scheduled steps not yet fetched, per worker: enough to keep every worker busy


def _run_steps(coordinator, train_step, iterator, count: int, in_flight: int, stopping=lambda: False):
    """Yield the metric deltas of `count` train steps, in order, with at most `in_flight` scheduled and
    not yet fetched. Fetching the oldest first is the progress; the window keeps a step that a dead
    worker gave back (TF re-queues it at the end) from waiting behind a whole epoch of others.
    Once `stopping()` is true nothing more is scheduled; the steps already scheduled still run and count."""
    scheduled = collections.deque()
    for _ in range(min(count, in_flight)):
        scheduled.append(coordinator.schedule(train_step, args=(iterator,)))
    left = count - len(scheduled)
    while scheduled:
        delta = _fetch(scheduled.popleft())
        if left > 0 and not stopping():
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


def _val_examples(payload: WorkerPayload, cache_dir: str) -> Examples | None:
    return Examples(payload, payload.val_data, False, cache_dir) if payload.spec.data.per_example else None


def _validation(payload: WorkerPayload, batch: int, cache_dir: str):
    """A function running eval_step over every validation row once, on the chief; returns the sums."""
    if payload.val_data is None:
        return None
    info = payload.val_data
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    steps = max(1, math.ceil(info.num_rows / batch))
    with tf.device(CHIEF_DEVICE):
        dataset = pipelines.eval_dataset(info, payload.val_root, shard, batch, steps, repeat=True,
                                         examples=_val_examples(payload, cache_dir))
        iterator = iter(dataset)

    def validate(eval_step) -> np.ndarray:
        total = None
        for _ in range(steps):
            delta = eval_step(*next(iterator)).numpy()
            total = delta if total is None else total + delta
        return total

    return validate


# ---------------------------------------------------------------- the evaluator side-car

EVALUATOR_POLL_S = 0.5


def run_evaluator(payload: WorkerPayload, ctx: TaskContext) -> Outcome:
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
    iterator = iter(pipelines.eval_dataset(info, payload.val_root, shard, batch, val_steps, repeat=True,
                                           examples=_val_examples(payload, ctx.staging_dir + ".cache")))

    @steps_lib.step_function
    def eval_step(x, y, w):
        pred = model(x, training=False)
        y = steps_lib.align_labels(y, pred)
        return acc.delta(y, pred, loss_fn(y, pred), weight=w, regularization=steps_lib.regularization_loss(model))

    storage = Storage(payload.checkpoint_dir)
    final_step = spec.train.epochs * steps_per_epoch(payload)
    evaluated: list[dict[str, Any]] = []
    last_step = payload.resume_from.step if payload.resume_from else -1
    ctx.channel.phase("waiting for a checkpoint")
    while last_step < final_step:
        try:
            latest = storage.latest()
        except RaytfError:  # the store briefly away: evaluation waits for it, as for a checkpoint
            latest = None
        if latest is None or latest.step <= last_step:
            time.sleep(EVALUATOR_POLL_S)
            ctx.channel.phase("waiting for a checkpoint")
            continue
        ctx.channel.phase("evaluating")
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
        ctx.channel.evaluation(entry)
        last_step = latest.step
    return Outcome(evaluations=evaluated, steps=last_step)


def _load_weights(storage: Storage, checkpoint: CheckpointInfo) -> list[np.ndarray]:
    local = tempfile.mkdtemp(prefix="raytf-eval-")
    try:
        storage.download(checkpoint, local)
        with np.load(os.path.join(local, WEIGHTS_FILE)) as saved:
            return [saved[f"arr_{i}"] for i in range(len(saved.files))]
    finally:
        shutil.rmtree(local, ignore_errors=True)
