"""What the driver and the actors send each other, as types both sides (and the tests' fakes) share.

A task process starts with the job's TaskCode; the driver sends each task a WorkerPayload; a task answers a poll
with its Progress, a drain notice's stop request with a StopAnswer, and its train call with an Outcome. Frozen
dataclasses (picklable for Ray): a field renamed on one side breaks the other at once. result.json stays plain
dicts (raytf.driver.report).
"""
from __future__ import annotations


import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Callable

from raytf.data import DatasetInfo
from raytf.spec import JobSpec, function_ref

if TYPE_CHECKING:  # a field's type only: raytf.checkpoint would bring pyarrow.fs to every importer of these types
    from raytf.checkpoint import CheckpointInfo

OUTPUTS = "outputs"  # in output.dir: what the chief's script wrote into its working folder (ctx.output_dir)


@dataclasses.dataclass(frozen=True)
class CodePackage:
    """A folder (or module file) of the job's code, zipped on the driver by Ray's own packaging function and
    kept in Ray's object store. `name` is Ray's content hash of it: the folder it unpacks to on a node."""

    name: str
    data: Any = dataclasses.field(compare=False, repr=False)  # an ObjectRef to the zip's bytes


@dataclasses.dataclass(frozen=True)
class TaskCode:
    """What a task process needs before anything else (raytf.actor.task_code): the job folder, the modules found
    only in the driver's working directory, and the environment variables TensorFlow reads when it is imported.
    Equal for two jobs whose code and variables are equal (a sweep's kept processes are matched on it)."""

    working_dir: CodePackage
    modules: tuple[CodePackage, ...] = ()
    env_vars: tuple[tuple[str, str], ...] = ()


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


@dataclasses.dataclass(frozen=True)
class Progress:
    """A task's answer to the driver's poll while it trains: its latest step (the progress line, the hang
    watchdog, a drain's stop step) and every epoch's metrics so far (so a slow poller misses none)."""

    phase: str = "starting"  # train, validating, checkpointing, epoch_end, evaluated, ...
    updated: float = 0.0  # epoch seconds of the last change
    rank: int | None = None
    pid: int | None = None
    global_step: int = 0
    epoch: int | None = None
    step: int | None = None  # within the epoch
    steps: int | None = None  # the epoch's steps
    loss: float | None = None
    examples_seen: int | None = None  # examples trained on so far: the driver's examples/s
    steps_per_s: float | None = None  # since the last full report: a drain's stop step
    checkpoint_s: float | None = None  # how long the last checkpoint took: against a drain's deadline
    work_done: int = 0  # units of work that are not its own steps (a parameter-server worker's functions)
    cpu_s: float | None = None  # the process's CPU time: a sign of life where no step is said
    epochs: tuple[dict[str, Any], ...] = ()
    evaluations: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class StopAnswer:
    """A task's answer to "stop after step S" (a drain notice): accepted only while it has not finished S."""

    accepted: bool
    step: int  # the last step this task finished


@dataclasses.dataclass(frozen=True)
class CheckpointSaved:
    step: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class DrainStop:
    """A loop that stopped at the step a drain notice set; `saved`: its checkpoint there (None: none made)."""

    step: int
    saved: CheckpointSaved | None = None
    request_to_step_s: float | None = None  # from the stop request to reaching the step


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a task's train call returns. The strategy's loop fills what it knows; the task actor adds where
    and when (rank, started_at, finished_at, first_step_at) and the files it wrote (artifacts)."""

    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the epochs' metrics
    steps: int | None = None  # the global step it ended at
    steps_run: int | None = None  # steps this attempt ran (steps less the restored step)
    weights_digest: str | None = None
    replicas: int | None = None
    optimizer_steps: int | None = None
    exports: dict[str, str] = dataclasses.field(default_factory=dict)  # format -> path in its staging folder
    load_note: str | None = None  # what loading model.keras as a user would takes, when more than load_model(path)
    timing: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # "worker-<i>" -> input wait, step time
    variable_devices: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # parameter servers, central_storage
    recovered_workers: list[str] = dataclasses.field(default_factory=list)  # the PS coordinator's
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the evaluator's
    preempted: DrainStop | None = None  # stopped for a drain notice
    rank: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    first_step_at: float | None = None
    artifacts: dict[str, bytes] = dataclasses.field(default_factory=dict)  # relative path -> contents
