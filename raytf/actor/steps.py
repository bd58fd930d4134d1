"""What every strategy's loop shares: building the model pieces from the spec, the train and eval step
functions, and metric accumulation that costs no cross-worker traffic until an epoch ends.

Metrics: each Keras metric is used statelessly. Per step a replica computes its metric-state *delta*
(update from zeros); deltas of this worker's replicas are added into local accumulators. At the end of
an epoch one all-reduce sums the accumulators of all workers and each metric's result is computed from
the global state. This is exact for Keras metrics whose state is sums (mean-style metrics, accuracy,
AUC, precision/recall), and is why raytf does not need Keras metric objects to be distribution-aware.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import math
import os
import time
from typing import Any, Callable

import keras
import tensorflow as tf

from raytf import learning_rate
from raytf.actor import initial_values, inputs, schedules
from raytf.labels import check_label_shape, loss_key
from raytf.spec import JobSpec

# raytf's step functions, traced without AutoGraph: they hold no Python control flow on tensors, so AutoGraph had
# nothing to convert in them, yet parsing and rewriting their source was most of a task's first trace (a restarted
# digits task: 1.15-1.2 s -> 0.5 s, benchmarks/bench_recovery.py). Keras 3's own fit traces without it too, and a
# model's call() was never converted either way (Keras is on AutoGraph's do-not-convert list).
step_function = functools.partial(tf.function, autograph=False)

# 'accuracy' in metrics, by the loss (its snake-case name): the accuracy that reads the labels that loss takes
_ACCURACY_BY_LOSS = {
    "sparse_categorical_crossentropy": "sparse_categorical_accuracy",
    "categorical_crossentropy": "categorical_accuracy",
    "categorical_focal_crossentropy": "categorical_accuracy",
    "binary_crossentropy": "binary_accuracy",
    "binary_focal_crossentropy": "binary_accuracy",
}


def build_loss(spec: JobSpec) -> Callable:
    """Per-example loss function (no reduction: the loop scales by the global batch). When traced, it checks
    the label's shape against the model's output (raytf.labels.check_label_shape: a SpecError naming both and
    the loss that fits, instead of a shape error from inside Keras); a label of shape (batch,) against an
    output (batch, 1) is aligned before (align_labels)."""
    fn = keras.losses.get(spec.loss.name)
    if isinstance(fn, keras.losses.Loss):
        config = fn.get_config()
        config.update(reduction=None)
        if "from_logits" in config:
            config["from_logits"] = spec.loss.from_logits
        fn = type(fn).from_config(config)
    elif "from_logits" in inspect.signature(fn).parameters:
        fn = functools.partial(fn, from_logits=spec.loss.from_logits)
    label = spec.data.label if spec.data is not None else None

    check = tf.autograph.experimental.do_not_convert(check_label_shape)  # plain Python while tracing

    def loss(y, pred):
        if isinstance(y, tf.Tensor) and isinstance(pred, tf.Tensor) and y.shape.rank and pred.shape.rank:
            check(spec.loss.name, label, tuple(y.shape[1:]), tuple(pred.shape[1:]))
        return fn(y, pred)

    return loss


def build_model(payload, strategy: tf.distribute.Strategy, steps_per_epoch: int,
                trained: Callable[[keras.Model], list] = lambda model: model.trainable_variables):
    """The job's model and optimizer under the strategy, in the spec's precision; the optimizer is built
    for `trained(model)` (the variables it updates), so its slots exist before a restore fills them."""
    spec = payload.spec
    keras.mixed_precision.set_global_policy(spec.train.precision)
    with strategy.scope(), _central_variables(strategy), initial_values.one_broadcast(strategy):
        model = payload.function("model")()
        if not isinstance(model, keras.Model):
            raise TypeError(f"model: {spec.model} returned {type(model).__name__}, not a keras.Model")
        build_variables(model, payload)
        optimizer = build_optimizer(spec, steps_per_epoch)
        targets = trained(model)
        optimizer.build(targets)
    return model, optimizer, targets


def _central_variables(strategy: tf.distribute.Strategy):
    """Under CentralStorageStrategy with several replicas, a variable a replica assigns in its step
    (BatchNormalization's moving statistics, Dropout's random state: Keras makes them with aggregation
    NONE) must say how the replicas' values combine, or TensorFlow refuses the assignment. They take the
    first replica's, as Keras's own layers do under MirroredStrategy without synchronized BatchNormalization.
    Entered inside strategy.scope(), so it comes before the strategy's own variable creator."""
    if not isinstance(strategy, tf.distribute.experimental.CentralStorageStrategy):
        return contextlib.nullcontext()

    def first_replica(next_creator, **kwargs):
        if not kwargs.get("trainable", True) and kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE):
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return next_creator(**kwargs)
    return tf.variable_creator_scope(first_replica)


def build_variables(model: keras.Model, payload) -> None:
    """A subclassed model has no variables until it is called: call it once on a zero row shaped like the
    job's features, so the optimizer, the gradient step and checkpoints see them."""
    if model.weights:
        return
    if payload.train_data is None:
        raise ValueError(f"model: {payload.spec.model} returned a model with no weights yet (a subclassed model "
                         f"is built by its first call); with dataset_fn raytf cannot know its inputs: call it once "
                         f"on a batch in the model function, or start it with keras.Input")
    model(inputs.sample_input(payload), training=False)


def build_optimizer(spec: JobSpec, steps_per_epoch: int) -> keras.optimizers.Optimizer:
    """The spec's optimizer, its learning rate scaled (optimizer.scale_lr) and scheduled in optimizer steps."""
    rate = schedules.build_schedule(learning_rate.in_steps(spec, steps_per_epoch))
    optimizer = keras.optimizers.get({"class_name": spec.optimizer.name,
                                      "config": {"learning_rate": rate, **spec.optimizer.options}})
    if spec.train.precision == "mixed_float16":  # float16 gradients underflow without loss scaling
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def build_metrics(spec: JobSpec) -> dict[str, keras.metrics.Metric]:
    """name in the spec -> a Keras metric object (used statelessly); 'accuracy' follows the loss."""
    out = {}
    for name in spec.metrics:
        resolved = _ACCURACY_BY_LOSS.get(loss_key(spec.loss.name), name) if name in ("accuracy", "acc") else name
        metric = keras.metrics.get(resolved)
        if inspect.isclass(metric):
            metric = metric(**_logit_options(metric, spec))
        elif isinstance(metric, keras.metrics.Metric) and _logit_options(type(metric), spec):
            metric = type(metric).from_config({**metric.get_config(), **_logit_options(type(metric), spec)})
        elif not isinstance(metric, keras.metrics.Metric):
            metric = keras.metrics.MeanMetricWrapper(metric, name=name)
        out[name] = metric
    return out


def _logit_options(metric_class, spec: JobSpec) -> dict[str, Any]:
    """A model that outputs logits (loss.from_logits) needs metrics that know it: AUC takes
    from_logits, and a binary accuracy's threshold moves from 0.5 to 0 (sigmoid(0) = 0.5)."""
    if not spec.loss.from_logits:
        return {}
    params = inspect.signature(metric_class.__init__).parameters
    if "from_logits" in params:
        return {"from_logits": True}
    if metric_class is keras.metrics.BinaryAccuracy:
        return {"threshold": 0.0}
    if metric_class in (keras.metrics.Precision, keras.metrics.Recall):
        return {"thresholds": 0.0}
    return {}


class Accumulator:
    """Local (per-worker) sums: loss total, example count and every metric's state variables."""

    def __init__(self, metrics: dict[str, keras.metrics.Metric]):
        self.metrics = metrics
        self._shapes = [(tf.TensorShape(()), tf.float64), (tf.TensorShape(()), tf.float64)]
        for metric in metrics.values():
            self._shapes += [(tf.TensorShape(v.shape), tf.float64) for v in metric.variables]
        self.sizes = [int(s.num_elements()) for s, _ in self._shapes]
        with tf.init_scope():
            self.total = tf.Variable(tf.zeros([sum(self.sizes)], tf.float64), trainable=False)
            self.last = tf.Variable(tf.zeros([sum(self.sizes)], tf.float64), trainable=False)  # the last step's

    def zero_deltas(self) -> list[list[tf.Tensor]]:
        return [[tf.zeros(v.shape, v.dtype) for v in m.variables] for m in self.metrics.values()]

    def delta(self, y, pred, per_example_loss, weight=None, regularization=None) -> tf.Tensor:
        """One replica's contribution as a flat float64 vector (replica context). `regularization`: the
        model's own losses for this batch (regularization_loss), counted per example, so that the reported
        loss is Keras's: the data loss's mean plus the model's losses."""
        if weight is None:
            weight = tf.ones_like(per_example_loss)
        weight = tf.cast(weight, per_example_loss.dtype)
        loss_sum = tf.reduce_sum(per_example_loss * weight)
        if regularization is not None:
            loss_sum += tf.cast(regularization, loss_sum.dtype) * tf.reduce_sum(weight)
        parts = [loss_sum, tf.reduce_sum(weight)]
        for metric, zeros in zip(self.metrics.values(), self.zero_deltas()):
            parts += metric.stateless_update_state(zeros, y, pred, sample_weight=weight)
        return tf.concat([tf.reshape(tf.cast(p, tf.float64), [-1]) for p in parts], axis=0)

    def results(self, totals) -> dict[str, float]:
        """Global sums -> {'loss': mean loss, metric name: value}."""
        flat = list(totals)
        pieces, i = [], 0
        for (shape, _), size in zip(self._shapes, self.sizes):
            pieces.append(tf.reshape(tf.constant(flat[i:i + size], tf.float64), shape))
            i += size
        loss_sum, count = float(pieces[0]), float(pieces[1])
        out = {"loss": loss_sum / count if count else float("nan")}
        j = 2
        for name, metric in self.metrics.items():
            n = len(metric.variables)
            state = [tf.cast(p, v.dtype) for p, v in zip(pieces[j:j + n], metric.variables)]
            out[name] = float(metric.stateless_result(state))
            j += n
        out["examples"] = int(round(count))
        return out


class StepTiming:
    """Where one worker's step time goes, measured inside the step's graph (no host sync, a few
    timestamps): input wait, from the step's start until its batch is there, and the rest of the step
    (forward, backward, all-reduce, apply; a worker that waits in the all-reduce for a slow peer waits
    here). Sums over this worker's steps but its first (whose input wait is the pipeline starting up):
    [input wait s, step s, steps]."""

    def __init__(self):
        with tf.init_scope():
            self.sums = tf.Variable(tf.zeros([3], tf.float64), trainable=False)
            self.started = tf.Variable(False, trainable=False)

    @staticmethod
    def fed(batch) -> tf.Tensor:
        """The time the batch is there (after every tensor of it)."""
        with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
            return tf.timestamp()

    def record(self, began: tf.Tensor, fed: tf.Tensor, done_after: list) -> None:
        with tf.control_dependencies(done_after):
            done = tf.timestamp()
        counted = tf.cast(self.started, tf.float64)
        self.sums.assign_add(counted * tf.stack([fed - began, done - fed, tf.constant(1.0, tf.float64)]))
        self.started.assign(True)

    def totals(self, rows_per_step: int) -> dict[str, float]:
        return timing_totals(self.sums.numpy(), rows_per_step)


def timing_totals(sums, rows_per_step: int) -> dict[str, float]:
    """[input wait s, step s, steps] as reported, with the worker's own examples/s over its timed steps."""
    wait, step, count = (float(v) for v in sums)
    busy = wait + step
    return {"input_wait_s": round(wait, 4), "step_s": round(step, 4), "timed_steps": int(count),
            "examples_per_s": round(count * rows_per_step / busy, 1) if busy > 0 else None}


@dataclasses.dataclass
class StepFunctions:
    train: Callable  # (iterator) -> local mean loss of this worker's replicas for the step
    evaluate: Callable  # (iterator) -> None
    global_sum: Callable  # (local vector) -> vector summed over all workers (a collective)
    sync_state: Callable  # () -> None: every replica's model state made the mean of all (a collective)
    timing: StepTiming | None  # this worker's input wait and step time (output.timing)


def synced_state(model: keras.Model) -> list:
    """The model's state that each replica updates on its own: non-trainable float weights such as
    BatchNormalization's moving mean and variance. Gradients are all-reduced, so trainable weights agree
    by construction; these do not (each replica's statistics are of its own batches) until synced.
    Keras 3 creates them with aggregation NONE, so TensorFlow leaves every replica its own copy."""
    return [v for v in model.non_trainable_weights if v.dtype.startswith(("float", "bfloat"))]


def make_state_sync(strategy: tf.distribute.Strategy, model: keras.Model) -> Callable[[], None]:
    """A function that sets each replica's `synced_state` to the mean over all replicas, in one all-reduce.
    A moving statistic is linear in the batch statistics it averages, so syncing at the end of every
    epoch leaves the same moving mean as averaging every step (what MirroredStrategy does for variables
    with aggregation MEAN), at the cost of one collective per epoch instead of one per step."""
    synced = synced_state(model)
    if not synced:
        return lambda: None
    sizes = [math.prod(v.shape) for v in synced]  # Keras shapes are tuples of ints

    def local_state():
        return tf.concat([tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in synced], axis=0)

    @step_function
    def sync():
        mean = strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(local_state), axis=None)
        for v, part in zip(synced, tf.split(mean, sizes)):
            v.assign(tf.reshape(tf.cast(part, v.dtype), v.shape))

    return sync


def regularization_loss(model: keras.Model):
    """The sum of the model's own losses (weight regularizers, add_loss) after its last call, in float32;
    None when it has none. Read inside the step that called the model."""
    if not model.losses:
        return None
    return tf.add_n([tf.cast(tf.reduce_sum(v), tf.float32) for v in model.losses])


def align_labels(y, pred):
    """A label column of shape (batch,) against a model output of shape (batch, 1), the usual binary
    classifier: give the labels the output's rank, as Keras's losses need."""
    if y.shape.rank is not None and pred.shape.rank == y.shape.rank + 1 and pred.shape[-1] == 1:
        return tf.expand_dims(y, -1)
    return y


def float32(pred):
    """Model outputs in float32 for the loss and metrics (mixed precision computes in 16 bits)."""
    return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t, pred)


def accumulate(gradients: Callable, sources: list, metric_size: int, micro_batches: int, take: Callable) -> Callable:
    """`gradients` over train.accumulation_steps micro-batches: (x, y, weight=None) holding K micro-batches
    (`take(tensor, k)` cuts out the k-th) -> (the sum of their gradients, the sum of their metric deltas).
    A while loop with parallel_iterations=1 runs one micro-batch after the other, so memory holds the
    activations of one micro-batch only. The gradients come from a loss already divided by the effective
    batch, so their sum is the gradient of the effective batch's mean loss. Sparse gradients (Embedding)
    are summed dense."""
    if micro_batches == 1:
        return gradients

    def accumulated(x, y, weight=None):
        unused: list[bool] = []  # variables the loss does not reach get None, as without accumulation

        def body(k, sums, delta):
            def part(t):
                return take(t, k)
            grads, step_delta = gradients(tf.nest.map_structure(part, x), part(y),
                                          None if weight is None else part(weight))
            unused[:] = [g is None for g in grads]
            sums = [s if g is None else s + tf.convert_to_tensor(g) for s, g in zip(sums, grads)]
            return k + 1, sums, delta + step_delta

        zeros = [tf.zeros(v.shape, v.dtype) for v in sources]
        _, sums, delta = tf.while_loop(lambda k, *_: k < micro_batches, body,
                                       (tf.constant(0), zeros, tf.zeros([metric_size], tf.float64)),
                                       parallel_iterations=1)
        return [None if skip else g for g, skip in zip(sums, unused)], delta

    return accumulated


def agree_on_overflow(grads: list) -> list:
    """Mixed float16 under MultiWorkerMirrored: make every replica see non-finite gradients when any
    replica's are. Keras 3's LossScaleOptimizer checks the gradients it is given, which are each
    replica's own (the all-reduce happens later, inside the inner optimizer); a worker that overflows
    alone would skip the step while the others enter its all-reduce, and the workers' collectives would
    drift apart. One scalar all-reduce per optimizer step keeps them in step."""
    present = [g for g in grads if g is not None]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g))) for g in present])
    overflowed = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32))
    poison = tf.where(overflowed > 0, float("nan"), 1.0)
    return [None if g is None else _scaled(g, poison) for g in grads]


def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _scaled(g, factor):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def make_gradients(model: keras.Model, optimizer, loss_fn, acc: Accumulator, global_batch_size: int,
                   sources: list, micro_batches: int = 1) -> Callable:
    """One replica's forward and backward pass, (x, y, weight=None) -> (gradients of `sources`, the
    step's metric delta): the per-example loss scaled by the global batch (and by the loss scale under
    mixed_float16), padding rows (weight 0) adding nothing, the model's own losses included as Keras's
    fit includes them: divided by the replicas in sync (tf.nn.scale_regularization_loss), so the gradient
    all-reduce (a sum) counts them once, and by `micro_batches` (train.accumulation_steps), whose
    gradients are summed, so once per optimizer step. The metric delta's loss is Keras's reported loss:
    the data loss plus the model's losses, unscaled."""

    def gradients(x, y, weight=None):
        with tf.GradientTape() as tape:
            pred = float32(model(x, training=True))
            y = align_labels(y, pred)
            per_example = loss_fn(y, pred)
            if weight is not None:  # padding rows (data.remainder: pad) weigh 0
                per_example = per_example * tf.cast(weight, per_example.dtype)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
            regularization = regularization_loss(model)
            if regularization is not None:
                loss += tf.nn.scale_regularization_loss(regularization) / micro_batches
            scaled = optimizer.scale_loss(loss)  # mixed_float16: loss scaling; otherwise the loss itself
        return tape.gradient(scaled, sources), acc.delta(y, pred, per_example, weight, regularization)

    return gradients


def make_step_functions(strategy: tf.distribute.Strategy, model: keras.Model, optimizer, loss_fn,
                        train_acc: Accumulator, eval_acc: Accumulator, spec: JobSpec) -> StepFunctions:
    """MultiWorkerMirrored's steps. A train step is one optimizer step: train.accumulation_steps
    micro-batches per replica (the iterator's elements hold them stacked on axis 0), then one all-reduce."""
    local_replicas = len(strategy.extended.worker_devices)
    variables = model.trainable_variables
    gradients = make_gradients(model, optimizer, loss_fn, train_acc, spec.train.effective_batch_size, variables,
                               micro_batches=spec.train.accumulation_steps)
    # XLA compiles the forward and backward pass; the gradient all-reduce in apply_gradients stays outside.
    compiled = step_function(gradients, jit_compile=True) if spec.train.jit_compile else gradients
    compiled = accumulate(compiled, variables, sum(train_acc.sizes), spec.train.accumulation_steps,
                          take=lambda t, k: t[k])
    loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def train_replica(x, y, weight=None):
        grads, delta = compiled(x, y, weight)
        if loss_scaled:
            grads = agree_on_overflow(grads)
        optimizer.apply_gradients(zip(grads, variables))  # unscales under loss scaling
        return delta

    # tf.timestamp is refused under op determinism (FailedPreconditionError)
    timing = StepTiming() if spec.output.timing and not spec.train.deterministic else None

    @step_function
    def train(iterator):
        began = tf.timestamp() if timing else None
        with tf.control_dependencies([began] if timing else []):
            batch = next(iterator)  # (x, y) or (x, y, weight)
        fed = timing.fed(batch) if timing else None
        deltas = strategy.experimental_local_results(strategy.run(train_replica, args=batch))
        step = tf.add_n(list(deltas))
        train_acc.total.assign_add(step)
        train_acc.last.assign(step)  # a step whose all-reduce failed may have added it: a rescue takes it back
        if timing:  # done once every variable is updated: after the all-reduce (waiting for peers included)
            timing.record(began, fed, [step, *(tf.identity(v.value) for v in variables)])
        return step[0] / tf.maximum(step[1], 1.0)

    def eval_replica(x, y, w):
        pred = float32(model(x, training=False))
        y = align_labels(y, pred)
        return eval_acc.delta(y, pred, loss_fn(y, pred), weight=w, regularization=regularization_loss(model))

    @step_function
    def evaluate(iterator):
        x, y, w = next(iterator)
        deltas = strategy.experimental_local_results(strategy.run(eval_replica, args=(x, y, w)))
        eval_acc.total.assign_add(tf.add_n(list(deltas)))

    @step_function
    def global_sum(local):
        # Each local replica contributes an equal share, so the SUM over all replicas is the sum over workers.
        share = strategy.run(lambda: local / tf.cast(local_replicas, tf.float64))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, share, axis=None)

    return StepFunctions(train=train, evaluate=evaluate, global_sum=global_sum,
                         sync_state=make_state_sync(strategy, model), timing=timing)


def random_state(model: keras.Model) -> list:
    """The model's random generators' state (Keras SeedGenerators: Dropout, GaussianNoise, random
    augmentation layers): its variables that are not weights."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def weights_digest(model: keras.Model) -> str:
    """sha256 over every weight's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(w.tobytes())
    return h.hexdigest()


def summary_writer(ctx):
    """TensorBoard events in the task's staging folder (the chief's is shipped back to output.dir)."""
    return tf.summary.create_file_writer(os.path.join(ctx.staging_dir, "tensorboard"))


def end_epoch(ctx, writer, history: list, metrics: dict[str, Any], val: dict[str, Any] | None, epoch: int,
              started: float, global_step: int) -> dict[str, Any]:
    """Fold the validation results into the epoch's metrics and record them: history, the driver
    (through ctx), TensorBoard."""
    if val is not None:
        metrics.update({f"val_{k}": v for k, v in val.items() if k != "examples"})
        metrics["val_examples"] = val["examples"]
    metrics.update(epoch=epoch, seconds=round(time.time() - started, 3), step=global_step)
    history.append(metrics)
    ctx.channel.epoch_end(metrics)
    if writer is not None:
        with writer.as_default(step=epoch):
            for k, v in metrics.items():
                if k not in ("epoch", "step") and isinstance(v, float):
                    tf.summary.scalar(k, v)
        writer.flush()
    return metrics


def checkpoint_due(interval: tuple[str, int], global_step: int, epoch: int) -> bool:
    """At the end of `epoch`: does checkpoint.every_steps / every_epochs ask for a checkpoint now?"""
    kind, every = interval
    return (kind == "steps" and global_step % every == 0) or (kind == "epochs" and epoch % every == 0)
