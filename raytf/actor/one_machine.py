"""The actor's half of the one-machine strategies: OneDeviceStrategy on this task's first GPU (or its CPU),
CentralStorageStrategy over its GPUs with the variables on its CPU. raytf's loop and train_fn loops are
mirrored's (raytf.actor.mirrored): they take any strategy."""
from __future__ import annotations

import os

import tensorflow as tf

from raytf import backends
from raytf.actor import mirrored
from raytf.actor.context import TaskContext
from raytf.protocol import Outcome, WorkerPayload


def prepare(task, payload: WorkerPayload, ctx: TaskContext) -> None:
    """Nothing before the strategy: one task reads all the data."""


def start(task, payload: WorkerPayload, ctx: TaskContext) -> tf.distribute.Strategy:
    """The strategy; neither starts a TensorFlow server. TF_CONFIG goes: one task is no cluster, and code
    that reads it (a model function, a train_fn) should not see one."""
    os.environ.pop("TF_CONFIG", None)
    return STRATEGIES[backends.get(payload.spec.strategy).tf_strategy](tf.config.list_logical_devices("GPU"))


STRATEGIES = {  # the backend's tf_strategy -> the strategy, given this task's GPUs
    "OneDeviceStrategy": lambda gpus: tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0"),
    # without GPUs, TensorFlow computes on the CPU, which also holds the variables
    "CentralStorageStrategy": lambda gpus: tf.distribute.experimental.CentralStorageStrategy(),
}


def train(strategy: tf.distribute.Strategy, task, payload: WorkerPayload, ctx: TaskContext) -> Outcome:
    return mirrored.run(strategy, payload, ctx)
