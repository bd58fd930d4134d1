"""train_fn under ParameterServerStrategy: the user's loop runs on the chief, with the coordinator at hand.

The chief builds the strategy (its variable partitioner from cluster.variable_partitioner) and a
ClusterCoordinator, then calls the train_fn with `ctx.strategy` and `ctx.coordinator`, as TensorFlow's
parameter-server tutorial has them; ps and worker tasks serve TF's gRPC server as for raytf's loop
(raytf.actor.parameter_server). What differs from a mirrored train_fn's ctx:

- `ctx.dataset("train")` is a worker's pipeline: each worker actor converted its shard to TFRecords
  (raytf.actor.parameter_server.prepare), and the dataset reads them by a path relative to the worker's
  working directory, with TF ops only, so one definition reads another shard on every worker. Use it
  inside the function given to `coordinator.create_per_worker_dataset` (or pass the dataset itself);
  `ctx.distributed_dataset("train")` is that per-worker dataset, ready for `iter` and `schedule`.
  Steps go to whichever worker is free, so an epoch is `ctx.steps_per_epoch` scheduled steps, not a pass.
- `ctx.dataset("validation")` runs on the chief (the tutorial's "direct evaluation"), every row once.
- `ctx.checkpoint(...)`: the chief writes every variable itself (they live on the ps tasks), after
  `coordinator.join()`, so the saved step matches the variables.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import tensorflow as tf

from raytf import data
from raytf.actor import own_loop, pipelines
from raytf.actor import inputs
from raytf.actor.context import TaskContext
from raytf.protocol import Outcome, WorkerPayload
from raytf.actor.examples import Examples
from raytf.actor.ps_common import CHIEF_DEVICE, WORKER_INDEX_FILE, partitioner, watch_recoveries


def run(payload: WorkerPayload, ctx: TaskContext) -> Outcome:
    recoveries = watch_recoveries()
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                                                     variable_partitioner=partitioner(payload.spec))
    # One coordinator per strategy (TF keeps it on the strategy): a train_fn that makes its own, or
    # tf.keras's model.fit, gets this one.
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    count_finished_steps(coordinator, ctx)
    outcome = own_loop.run(strategy, payload, ctx, ParameterServerOwnLoop(strategy, payload, ctx, coordinator))
    return dataclasses.replace(outcome, recovered_workers=recoveries.recovered)


def count_finished_steps(coordinator, ctx: TaskContext) -> None:
    """Each function a worker finishes for the coordinator is progress for the hang watchdog: the chief of a
    train_fn waits in coordinator.join() with its CPU idle while the workers run a long epoch. Through the
    coordinator's closure queue (TF-private; TF is pinned to 2.21.*): if it moved, ctx.step is the way."""
    closures = getattr(getattr(coordinator, "_cluster", None), "closure_queue", None)
    finished = getattr(closures, "mark_finished", None)
    if finished is None:
        return

    def mark_finished():
        finished()
        ctx.channel.work_done()

    closures.mark_finished = mark_finished


class ParameterServerOwnLoop(own_loop.OwnLoop):
    """The data and checkpoints behind a train_fn's ctx on the parameter-server chief."""

    def __init__(self, strategy, payload: WorkerPayload, ctx: TaskContext, coordinator):
        self.coordinator = coordinator
        super().__init__(strategy, payload, ctx)

    def plan_input(self) -> None:
        spec, info = self.payload.spec, self.payload.train_data
        self.examples = None
        if info is None:
            return
        self.steps_per_epoch = inputs.steps_per_epoch(spec, info.num_rows)
        if spec.data.per_example:  # traced on the chief, run as a graph on each worker
            self.examples = Examples(self.payload, info, training=True)
        if self.payload.val_data is not None:  # on the chief, in batches of the global batch
            self.validation_steps = max(1, math.ceil(self.payload.val_data.num_rows / spec.train.global_batch_size))

    def dataset(self, name: str, epoch: int | None, skip: int) -> tf.data.Dataset:
        if name == "validation":
            self._need_data(name)
            if epoch is not None or skip:
                raise ValueError("ctx.dataset('validation') is one whole pass: it takes no epoch or skip")
            return self._validation()
        return self._train(self._train_seed(name, epoch, skip))

    def distributed_dataset(self, name: str, epoch: int | None, skip: int):
        """The per-worker dataset of `dataset(name, ...)` (coordinator.create_per_worker_dataset), through
        strategy.distribute_datasets_from_function as TensorFlow's tutorial has it: `iter` it, and pass the
        iterator to the function you schedule."""
        if name == "validation":
            raise ValueError("ctx.distributed_dataset('validation'): under parameter_server validation runs on the "
                             "chief; iterate ctx.dataset('validation') there")
        seed = self._train_seed(name, epoch, skip)
        return self.coordinator.create_per_worker_dataset(
            lambda: self.strategy.distribute_datasets_from_function(lambda _: self._train(seed)))

    def _need_data(self, name: str) -> None:
        if self.payload.train_data is None:
            raise ValueError(f"ctx.dataset({name!r}): the job has no data section; give data.train (Parquet) in the "
                             f"job spec, or build the dataset in the train_fn")
        if name == "validation" and self.payload.val_data is None:
            raise ValueError("ctx.dataset('validation'): the job has no data.validation; add one to the job spec")
        if name not in ("train", "validation"):
            raise ValueError(f"ctx.dataset({name!r}): the data sets are 'train' and 'validation'")

    def _train_seed(self, name: str, epoch: int | None, skip: int) -> int:
        """The checks of a train dataset's arguments; its shuffle seed."""
        self._need_data(name)
        if epoch is not None:
            raise ValueError(
                f"ctx.dataset('train', epoch={epoch}): under parameter_server each worker streams its shard endlessly "
                f"and ClusterCoordinator gives each step to whichever worker is free, so an epoch is "
                f"ctx.steps_per_epoch scheduled steps, not a pass over the rows; leave out epoch")
        if skip < 0:
            raise ValueError(f"ctx.dataset('train', skip={skip}): skip is the steps already done, 0 or more")
        # As raytf's loop: a resumed run starts a new order, not the first epoch's again.
        return self.payload.spec.train.seed + skip // self.steps_per_epoch + 1

    def _train(self, seed: int) -> tf.data.Dataset:
        """This worker's records, endlessly, in batches of ctx.per_replica_batch_size (the global batch on
        CPU workers). Dataset ops only, so it can be built on the chief and run on a worker."""
        spec, info = self.payload.spec, self.payload.train_data
        folder, batch = f"{pipelines.RECORDS_DIR}/train", self.per_replica_batch_size
        if self.examples is None:
            return pipelines.record_dataset(info, folder, batch, spec.train.shuffle_buffer, seed)
        # The per-example seeds need this worker's index: read inside the pipeline, on the worker.
        index = tf.data.Dataset.from_tensors(WORKER_INDEX_FILE).map(
            lambda path: tf.strings.to_number(tf.io.read_file(path), tf.int32))
        return index.flat_map(lambda worker: pipelines.record_dataset(info, folder, batch, spec.train.shuffle_buffer,
                                                                      seed, examples=self.examples, worker=worker))

    def _validation(self) -> tf.data.Dataset:
        p = self.payload
        info = p.val_data
        shard = data.plan_shards([piece.num_rows for piece in info.pieces], 1)[0]
        examples = Examples(p, info, False, self.ctx.staging_dir + ".cache") if p.spec.data.per_example else None
        with tf.device(CHIEF_DEVICE):
            return pipelines.eval_dataset(info, p.val_root, shard, p.spec.train.global_batch_size,
                                          self.validation_steps, repeat=False, examples=examples)

    def checkpoint_settings(self) -> dict[str, Any]:
        # The chief writes every variable (TF would otherwise write each one's part on its ps host), once
        # the scheduled steps are done.
        return {"options": tf.train.CheckpointOptions(experimental_io_device=CHIEF_DEVICE),
                "before_save": self.coordinator.join}

    def finish(self) -> None:
        self.coordinator.join()  # steps still scheduled when the train_fn returned; their errors surface here
