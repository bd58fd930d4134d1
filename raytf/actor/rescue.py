"""A survivor's state when a peer dies mid-run: the restart's starting point instead of the last checkpoint, so a
killed worker costs no steps (raytf's loop under MultiWorkerMirroredStrategy).

Every worker holds the whole model and optimizer state, the same on all after each step: a step's gradients are
all-reduced in one collective (TensorFlow packs a tf.function's all-reduces into one), and no variable is updated
before it completes. A peer that dies makes the survivors' next collective fail, leaving their trainable weights
and optimizer slots as every worker had them after the last step all finished. A survivor writes that state
here, with no collective (tens of milliseconds), and keeps it in memory; the driver asks the survivor that got
furthest to upload it to checkpoint.dir as an ordinary checkpoint (raytf.driver.rescue), and the restart resumes
from it. Not exact, and said in docs/concepts/how-a-job-runs.md: BatchNormalization's moving statistics are the
rescuing worker's own since the last sync (one batch more: the failed step's forward pass), and so is Dropout's
random state; the unfinished epoch's training metrics so far are the rescuing worker's sums times the workers.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import tensorflow as tf

from raytf.checkpoint import Storage

# How a collective fails when a peer is gone: its connection reset (Unavailable), the collective aborted or
# cancelled, or cluster.collective_timeout_s passed (DeadlineExceeded). Anything else is the step's own error.
PEER_LOST = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
             tf.errors.DeadlineExceededError)


@dataclasses.dataclass
class Rescue:
    """A survivor's state: the checkpoint's files (bytes, held in memory: the task's folder goes when train
    returns) and its raytf.json."""

    step: int
    meta: dict[str, Any]
    files: dict[str, bytes]
    location: str  # checkpoint.dir
    keep: int  # checkpoint.keep

    def upload(self) -> str:
        """Upload as an ordinary checkpoint (raytf.json last), prune to checkpoint.keep; returns its path."""
        local = tempfile.mkdtemp(prefix="raytf-rescue-")
        try:
            for name, data in self.files.items():
                with open(os.path.join(local, name), "wb") as f:
                    f.write(data)
            storage = Storage(self.location)
            path = storage.upload(local, self.meta)
            storage.prune(self.keep)
            return path
        finally:
            shutil.rmtree(local, ignore_errors=True)


def take(state: tf.train.Checkpoint, optimizer, at: tuple[int, int, int], first: tuple[int, int], history: list,
         totals, world_size: int, extras, location: str, keep: int) -> Rescue:
    """The state after global step `at` = (epoch, steps of it done, global step) as a checkpoint in memory.
    `first`: (global step, the optimizer's step count) when this attempt began. An epoch at its end whose metrics
    are in `history` is resumed at the next one; otherwise `totals` are its sums so far (estimated).
    `extras(folder)`: the runner's other files and metadata. `location`, `keep`: checkpoint.dir and .keep."""
    epoch, step_in_epoch, global_step = at
    # Keras counts the failed step's apply before its all-reduce fails: the optimizer's step count (its
    # learning-rate schedule's clock) is set back to the steps really done.
    optimizer.iterations.assign(first[1] + global_step - first[0])
    if history and history[-1].get("epoch") == epoch:
        epoch, step_in_epoch, totals = epoch + 1, 0, None
    local = tempfile.mkdtemp(prefix="raytf-rescue-")
    try:
        state.write(os.path.join(local, "state"))
        meta = {"step": global_step, "epoch": epoch, "step_in_epoch": step_in_epoch, "history": list(history),
                "epoch_totals": None if totals is None else np.asarray(totals, np.float64).tolist(),
                **extras(local), "world_size": world_size, "saved_at": time.time(), "rescued": True}
        files = {}
        for name in os.listdir(local):
            with open(os.path.join(local, name), "rb") as f:
                files[name] = f.read()
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return Rescue(global_step, meta, files, location, keep)


def estimated_totals(local, local_base, epoch_base, world_size: int) -> np.ndarray:
    """An epoch's metric sums over all workers, from one rank's: what it added since the epoch (or the resume)
    began, times the workers, plus the sums restored (`epoch_base`, global; `local_base`: the part of it this
    rank's accumulator began with, the chief's)."""
    added = np.asarray(local, np.float64) - (0.0 if local_base is None else np.asarray(local_base, np.float64))
    return added * world_size + (0.0 if epoch_base is None else np.asarray(epoch_base, np.float64))
