"""What the driver and the actors send each other, as types both sides (and the tests' fakes) share.

The driver sends each task a WorkerPayload; the task's answers are in raytf.actor.context (progress polled
while it trains) and the train functions' outcome dicts.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from raytf.checkpoint import CheckpointInfo
from raytf.data import DatasetInfo
from raytf.spec import JobSpec, function_ref


@dataclasses.dataclass(frozen=True)
class WorkerPayload:
    """Everything a worker needs to train: the spec and the data sets as the actor will see them."""

    spec: JobSpec
    train_data: DatasetInfo | None = None
    train_root: str | None = None
    val_data: DatasetInfo | None = None
    val_root: str | None = None
    checkpoint_dir: str | None = None  # absolute path or URI, the same for every process
    resume_from: CheckpointInfo | None = None
    job_dir: str | None = None  # the job folder on the driver's machine: errors name files relative to it

    def function(self, key: str) -> Callable:
        """Import spec.<key> (`module:function`; key as in spec.FUNCTION_KEYS, e.g. data.preprocess) inside the
        actor; its working dir is the job folder."""
        module_name, _, func_name = function_ref(self.spec, key).partition(":")
        return getattr(importlib.import_module(module_name), func_name)
