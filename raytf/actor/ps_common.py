"""What both loops of a parameter-server chief share (raytf's loop in raytf.actor.parameter_server, a train_fn's
in raytf.actor.ps_own_loop): where the chief's ops run, how variables are split over the ps tasks, the file
naming a worker's index, and the coordinator's log of lost workers it took back."""
from __future__ import annotations

import logging

import tensorflow as tf

from raytf.actor import pipelines
from raytf.spec import JobSpec, PartitionerSpec

CHIEF_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"
WORKER_INDEX_FILE = f"{pipelines.RECORDS_DIR}/worker-index"


def partitioner(spec: JobSpec):
    part = spec.cluster.variable_partitioner or PartitionerSpec()
    if part.kind == "fixed":
        return tf.distribute.experimental.partitioners.FixedShardsPartitioner(part.shards)
    return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=part.min_shard_bytes,
                                                                       max_shards=spec.cluster.ps)


class _RecoveryLog(logging.Handler):
    """Catches the coordinator's "Worker ... has been recovered." (TF logs it at INFO): which lost
    workers it took back."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.recovered: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().endswith("has been recovered."):
            self.recovered.append(record.getMessage().split()[1])


def watch_recoveries() -> _RecoveryLog:
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
