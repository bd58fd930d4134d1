"""What a worker feeds its model: the plan of an epoch's input (steps, each worker's shards, the dataset
functions over raytf.actor.pipelines) from the Parquet metadata, and one sample row as the model takes it (to build variables and the
serving signature). Shared by raytf's loop, a train_fn's ctx.dataset and the export.
"""
from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from raytf import data
from raytf.protocol import WorkerPayload
from raytf.actor import pipelines, shard_reader
from raytf.actor.examples import Examples
from raytf.data import Column
from raytf.spec import JobSpec


def steps_per_epoch(spec: JobSpec, rows: int, padded: int | None = None, hint: str = "") -> int:
    """Optimizer steps per epoch: train.steps_per_epoch when given, else the effective global batches
    (global_batch_size x accumulation_steps) the training rows fill (`padded`: with data.remainder: pad,
    as many as the largest shard needs)."""
    if spec.train.steps_per_epoch:
        return spec.train.steps_per_epoch
    batch = spec.train.effective_batch_size
    steps = padded if padded is not None else rows // batch
    if steps == 0:
        raise ValueError(f"data.train has {rows} rows, fewer than one global batch of {spec.train.describe_batch()}; lower "
                         f"train.global_batch_size{hint}")
    return steps


class InputPlan:
    """Steps per epoch and the per-worker input functions, from the Parquet metadata (raytf's loop, and a
    train_fn's ctx.dataset)."""

    def __init__(self, payload: WorkerPayload, world_size: int, per_replica: int, local_replicas: int,
                 cache_dir: str | None = None):
        """cache_dir: this task's folder for data.cache: disk."""
        spec = payload.spec
        self.payload, self.per_replica, self.local_replicas = payload, per_replica, local_replicas
        self.cache_dir = cache_dir
        self.shuffle_buffer = spec.train.shuffle_buffer
        self.micro_batches = spec.train.accumulation_steps
        per_worker = per_replica * local_replicas
        if payload.train_data is None:  # dataset_fn: the user's pipeline, the spec's step count
            self.steps, self.val_steps = spec.train.steps_per_epoch, 0
            return
        rows = payload.train_data.num_rows
        self.train_shards = data.plan_shards([p.num_rows for p in payload.train_data.pieces], world_size)
        self.pad = spec.data.remainder == "pad"
        padded = None
        if self.pad:  # every row once per epoch: enough batches for the largest shard, padded
            padded = math.ceil(max(data.shard_rows(s) for s in self.train_shards) / (per_worker * self.micro_batches))
        self.steps = steps_per_epoch(spec, rows, padded, hint=" or use data.remainder: pad")
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
            ds = pipelines.train_dataset(p.train_data, p.train_root, shard, self.per_replica,
                                         self.steps * self.local_replicas * self.micro_batches, self.shuffle_buffer,
                                         seed, first_epoch=first_epoch, pad=self.pad, micro_batches=self.micro_batches,
                                         examples=self._examples(p.train_data, training=True),
                                         worker=input_context.input_pipeline_id)
            return ds.skip(skip_batches * self.local_replicas) if skip_batches else ds

        return dataset_fn

    def val_input(self, repeat: bool = True):
        """Every validation row once per pass; `repeat`: the same pass for every epoch, one pipeline."""
        p = self.payload

        def dataset_fn(input_context: tf.distribute.InputContext):
            shard = self.val_shards[input_context.input_pipeline_id]
            return pipelines.eval_dataset(p.val_data, p.val_root, shard, self.per_replica,
                                          self.val_steps * self.local_replicas, repeat=repeat,
                                          examples=self._examples(p.val_data, training=False),
                                          worker=input_context.input_pipeline_id)

        return dataset_fn

    def _examples(self, info: data.DatasetInfo, training: bool) -> Examples | None:
        """The per-example maps (data.decode/preprocess/cache), when the spec asks for them."""
        if not self.payload.spec.data.per_example:
            return None
        return Examples(self.payload, info, training, self.cache_dir)


def micro_batched(dataset_fn, micro_batches: int):
    """A user's dataset_fn whose batches are stacked in groups of train.accumulation_steps (one optimizer step each)."""
    if micro_batches == 1:
        return dataset_fn
    return lambda input_context: dataset_fn(input_context).batch(micro_batches, drop_remainder=True)


def input_specs(features: tuple[Column, ...]) -> dict[str, tf.TensorSpec]:
    """One TensorSpec per feature column, named after it: (None, *the row's shape)."""
    return {c.name: tf.TensorSpec((None, *c.shape), tf.as_dtype(c.tf_dtype), name=c.name) for c in features}


def model_input(features: tuple[Column, ...], inputs: dict[str, tf.Tensor]):
    """What the model takes: the one feature's tensor, or the dict by column name (as raytf's data feeds it)."""
    return inputs[features[0].name] if len(features) == 1 else dict(inputs)


def zero_row(features: tuple[Column, ...]) -> dict[str, tf.Tensor]:
    """One row of zeros (empty strings) per feature column, by name."""
    return {name: tf.zeros([1, *spec.shape[1:]], spec.dtype) for name, spec in input_specs(features).items()}


def sample_input(payload) -> Any:
    """One row as the model takes it: zeros shaped like the feature columns, or, when rows go through
    data.decode/preprocess, the first training row through them (their output shapes are theirs to say)."""
    features = payload.train_data.features
    if not payload.spec.data.per_example:
        return model_input(features, zero_row(features))
    rows = next(shard_reader.iter_shard(payload.train_data, payload.train_root, [data.Slice(0, 0, 1)]))
    return Examples(payload, payload.train_data, training=False).model_input(rows)
