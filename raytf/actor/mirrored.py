"""The actor's half of the mirrored backend: raytf's loop (raytf.actor.loop) under
MultiWorkerMirroredStrategy (Keras 3 `model.fit` fails under it on TF 2.21), and `train_fn` loops.

Runs inside every worker actor, after TF_CONFIG is set and the strategy is built. All workers execute
the same number of steps per epoch (planned from Parquet metadata, or train.steps_per_epoch), which is
what keeps the collectives from hanging; metric sums are all-reduced at the end of each epoch (and at
a mid-epoch checkpoint, which saves them), not every step.
"""
from __future__ import annotations

import os
from typing import Any, Iterator

import keras
import numpy as np
import tensorflow as tf

from raytf import backends
from raytf.actor import export, inputs, loop
from raytf.actor import steps as steps_lib
from raytf.actor.context import TaskContext
from raytf.protocol import Outcome, WorkerPayload

# ---------------------------------------------------------------- the actor's half of the backend


def prepare(task, payload: WorkerPayload, ctx: TaskContext) -> None:
    """Nothing to do before TensorFlow's server starts: every worker reads its own Parquet shard."""


COMMUNICATION = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                 "ring": tf.distribute.experimental.CommunicationImplementation.RING,
                 "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}


def start(task, payload: WorkerPayload, ctx: TaskContext) -> tf.distribute.Strategy:
    """The strategy (it starts this task's gRPC server, on the port in TF_CONFIG), its collectives as
    cluster.communication and cluster.collective_timeout_s say."""
    cluster = payload.spec.cluster
    if cluster.communication == "nccl" and not tf.config.list_physical_devices("GPU"):
        raise ValueError(f"cluster.communication: nccl needs a GPU on every worker, and rank {ctx.rank} sees none "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use communication: "
                         f"ring (or auto)")
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=COMMUNICATION[cluster.communication], timeout_seconds=cluster.collective_timeout_s)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def train(strategy: tf.distribute.Strategy, task, payload: WorkerPayload, ctx: TaskContext) -> Outcome:
    return run(strategy, payload, ctx)


def run(strategy: tf.distribute.Strategy, payload: WorkerPayload, ctx: TaskContext) -> Outcome:
    if payload.spec.train_fn is not None:
        from raytf.actor import own_loop

        return own_loop.run(strategy, payload, ctx)
    return loop.run(MirroredRunner(strategy, payload, ctx), payload, ctx)


def survivor_state_is_exact(model: keras.Model, deterministic: bool) -> bool:
    """Whether a survivor's state may be a restart's starting point (raytf.actor.rescue). It holds the failed step's
    forward pass in its BatchNormalization statistics and Dropout's random state: a `train.deterministic` run
    with either resumes bit for bit only from a checkpoint."""
    return not (deterministic and (steps_lib.synced_state(model) or steps_lib.random_state(model)))


class MirroredRunner:
    """raytf's loop under MultiWorkerMirroredStrategy: each step is a `strategy.run` on every worker (its
    gradient all-reduce the step's only collective); metric deltas add up in a per-worker accumulator,
    all-reduced when the loop asks for the epoch's sums (at its end, and at a mid-epoch checkpoint)."""

    own_timing = True  # raytf.actor.loop.Runner
    rescuable = True  # every worker holds the whole state (raytf.actor.rescue)

    def __init__(self, strategy: tf.distribute.Strategy, payload: WorkerPayload, ctx: TaskContext):
        spec = payload.spec
        self.strategy, self.payload, self.ctx = strategy, payload, ctx
        keras.utils.set_random_seed(spec.train.seed)
        replicas = strategy.num_replicas_in_sync
        local_replicas = len(strategy.extended.worker_devices)
        global_batch = spec.train.global_batch_size
        if global_batch % replicas:
            raise ValueError(f"train.global_batch_size {global_batch} is not divisible by the {replicas} replicas "
                             f"TensorFlow found ({local_replicas} per worker)")
        self.replicas = replicas
        self.plan = inputs.InputPlan(payload, ctx.world_size, global_batch // replicas, local_replicas,
                              cache_dir=ctx.staging_dir + ".cache")
        self.steps = self.plan.steps
        self.model, self.optimizer, _ = steps_lib.build_model(payload, strategy, self.steps)
        self.deterministic = spec.train.deterministic
        # Dropout's random state (Keras SeedGenerators) is not a weight, and not saved with the model: a
        # deterministic run keeps it in its checkpoints, so a resumed run draws the masks it would have drawn.
        randomness = {"random_state": steps_lib.random_state(self.model)} if self.deterministic else {}
        self.state = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, **randomness)
        self.rescuable = survivor_state_is_exact(self.model, self.deterministic)
        loss_fn = steps_lib.build_loss(spec)
        self.train_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
        self.eval_acc = steps_lib.Accumulator(steps_lib.build_metrics(spec))
        self.fns = steps_lib.make_step_functions(strategy, self.model, self.optimizer, loss_fn, self.train_acc,
                                                 self.eval_acc, spec)
        self.validates = bool(self.plan.val_steps)
        self._iterator = None
        self._val_iterator = None

    def _iterators(self, epoch: int) -> None:
        """One iterator for all epochs, built when the first epoch starts (a resume's epoch, less the
        batches of it already trained: the rest of the epoch's data comes in the same order). Building a
        distributed pipeline costs ~0.1 s; an epoch of a small job may be shorter than that. The validation
        iterator waits for the first validation: a restart's first step does not wait for it."""
        spec, position = self.payload.spec, self.payload.resume_from
        if spec.dataset_fn is not None:
            self._iterator = iter(self.strategy.distribute_datasets_from_function(
                inputs.micro_batched(self.payload.function("dataset_fn"), spec.train.accumulation_steps)))
        else:
            skip = position.step_in_epoch if position is not None and position.epoch == epoch else 0
            self._iterator = iter(self.strategy.distribute_datasets_from_function(
                self.plan.train_input(spec.train.seed, first_epoch=epoch, skip_batches=skip)))

    def start_epoch(self, epoch: int, totals: np.ndarray | None) -> None:
        if self._iterator is None:
            self._iterators(epoch)
        # A resumed epoch's sums so far are global: one worker carries them, so the all-reduce counts them once.
        start = totals if totals is not None and self.ctx.is_chief else np.zeros(sum(self.train_acc.sizes))
        self.train_acc.total.assign(tf.constant(start, tf.float64))

    def train(self, count: int, epoch: int, stopping=lambda: False) -> Iterator[Any]:
        for _ in range(count):
            if stopping():
                return
            try:
                yield self.fns.train(self._iterator)
            except tf.errors.OutOfRangeError:
                raise ValueError(f"dataset_fn's dataset ended during epoch {epoch}; make it longer (e.g. .repeat()) "
                                 f"or lower train.steps_per_epoch") from None
            except tf.errors.DeadlineExceededError:
                timeout_s = self.payload.spec.cluster.collective_timeout_s
                if timeout_s is None:
                    raise
                raise tf.errors.DeadlineExceededError(  # the same class: still a (restartable) collective failure
                    None, None, f"a collective did not complete within cluster.collective_timeout_s ({timeout_s:g} s): "
                                f"a peer is stalled or unreachable") from None

    def epoch_totals(self) -> np.ndarray:
        return self.fns.global_sum(self.train_acc.total.read_value()).numpy()

    def epoch_notes(self) -> dict[str, Any]:
        return {}

    def sync_state(self) -> None:
        self.fns.sync_state()

    def validate(self) -> np.ndarray:
        if self._val_iterator is None:
            self._val_iterator = iter(self.strategy.distribute_datasets_from_function(self.plan.val_input()))
        self.eval_acc.total.assign(tf.zeros_like(self.eval_acc.total))
        for _ in range(self.plan.val_steps):
            self.fns.evaluate(self._val_iterator)
        return self.fns.global_sum(self.eval_acc.total.read_value()).numpy()

    def checkpoint_options(self):
        return None

    def checkpoint_extras(self, local_dir: str) -> dict[str, Any]:
        return {"deterministic": True} if self.deterministic else {}

    def check_restorable(self, meta: dict[str, Any], path: str) -> None:
        if self.deterministic and not meta.get("deterministic"):
            raise ValueError(f"checkpoint {path} was written by a run without train.deterministic and holds no random "
                             f"state to continue from; resume it without train.deterministic, or start afresh in "
                             f"another checkpoint.dir")

    def final_checkpoint_needed(self) -> bool:
        return False

    def timing(self) -> dict[str, dict[str, float]]:
        rows = self.plan.per_replica * self.plan.local_replicas * self.plan.micro_batches  # this worker's, per step
        return {f"worker-{self.ctx.rank}": self.fns.timing.totals(rows)} if self.fns.timing else {}

    def finish(self) -> Outcome:
        exports = export.write(self.model, self.payload, self.ctx.staging_dir) if self.ctx.is_chief else {}
        # where each variable lives, where that is a choice (central_storage: the CPU), not a copy per replica
        central = not backends.get(self.payload.spec.strategy).replicated_variables
        devices = {v.path: [v.value.device] for v in self.model.weights} if central else {}
        return Outcome(weights_digest=steps_lib.weights_digest(self.model), replicas=self.replicas,
                       optimizer_steps=int(self.optimizer.iterations.numpy()), exports=exports,
                       variable_devices=devices)
