"""What one attempt of a job holds while it runs, for the controller (raytf.driver.controller): the payload
its tasks get, the epochs fed on to the display and the callbacks, the chief's example rate, a dead task's
replacement starting in a thread, and the attempt's own state."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

from raytf.driver.callbacks import Callback
from raytf.driver.drain import DrainWatch
from raytf.driver.group import WorkerGroup
from raytf.driver.policy import Heard, ReplacementPolicy
from raytf.driver.report import ProgressDisplay
from raytf.job import Job
from raytf.protocol import Outcome, Progress, WorkerPayload
from raytf.rendezvous import Task


def build_payload(job: Job) -> WorkerPayload:
    spec = job.spec
    if spec.data is None:
        return WorkerPayload(spec=spec, checkpoint_dir=job.checkpoint_dir, job_dir=str(job.job_dir))
    val = spec.data.validation
    return WorkerPayload(
        spec=spec, job_dir=str(job.job_dir),
        train_data=job.datasets.get("train"), train_root=job.actor_data_path(spec.data.train),
        val_data=job.datasets.get("validation"), val_root=job.actor_data_path(val) if val else None,
        checkpoint_dir=job.checkpoint_dir,
    )


class EpochFeed:
    """Hands each finished epoch's metrics, once and in order, to the display and to the callbacks (MLflow,
    Ray Tune's report), across restarts."""

    def __init__(self, display: ProgressDisplay, callbacks: Sequence[Callback] = ()):
        self.display, self.callbacks, self.last = display, callbacks, 0
        self.history: list[dict[str, Any]] = []  # every epoch fed, in order

    def feed(self, epochs: list[dict[str, Any]]) -> None:
        for metrics in epochs:
            if metrics.get("epoch", 0) > self.last:
                self.last = metrics["epoch"]
                self.history.append(dict(metrics))
                self.display.epoch(metrics)
                for callback in self.callbacks:
                    callback.on_epoch(dict(metrics))


class Rate:
    """examples/s from the chief's running example count."""

    def __init__(self):
        self._prev: tuple[float, int] | None = None
        self.value: float | None = None

    def update(self, p: Progress | None) -> float | None:
        if p is None or p.examples_seen is None:
            return self.value
        point = (p.updated, p.examples_seen)
        if self._prev and point[0] > self._prev[0] and point[1] > self._prev[1]:
            self.value = (point[1] - self._prev[1]) / (point[0] - self._prev[0])
        if not self._prev or point[1] != self._prev[1]:
            self._prev = point
        return self.value


class Replacement:
    """A new actor for a dead task, in its bundle and at its address (TF's cluster is fixed at start),
    started in a thread so the supervisor keeps watching meanwhile. `handle`: its train handle once set up."""

    def __init__(self, group: WorkerGroup, task: Task, payload: WorkerPayload, loss: dict):
        self.task, self.loss = task, loss
        self.handle, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(group, payload), daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    def _run(self, group: WorkerGroup, payload: WorkerPayload) -> None:
        try:
            self.handle = group.replace(self.task, payload, payload.spec.cluster.start_timeout_s)
        except Exception as exc:
            self.error = str(exc)


@dataclasses.dataclass
class Attempt:
    """What one attempt holds while it runs."""

    spec: Any
    payload: WorkerPayload
    bundles: list[dict[str, float]]
    group: WorkerGroup | None = None
    rendezvous_tries: int = 0
    tasks: list[Task] = dataclasses.field(default_factory=list)
    task_of: dict = dataclasses.field(default_factory=dict)  # train handle -> task
    awaited: list = dataclasses.field(default_factory=list)  # handles the attempt waits for
    side: list = dataclasses.field(default_factory=list)  # handles not waited for whose failure is handled
    outcomes: dict[int, Outcome] = dataclasses.field(default_factory=dict)  # by rank
    progress_seen: dict[int, Heard] = dataclasses.field(default_factory=dict)  # watched rank -> its last progress
    training_done_at: float | None = None  # every hang-watched task returned (an evaluator may go on)
    replacing: list[Replacement] = dataclasses.field(default_factory=list)
    replacements: ReplacementPolicy | None = None
    standby_armed: bool = False
    hangs_named: set[int] = dataclasses.field(default_factory=set)  # ranks whose hang was reported (hang_mode observe)
    drains: DrainWatch | None = None  # its nodes' drain notices (raytf.driver.drain)
    last_step: int = 0  # the furthest optimizer step any rank reported

    def collect_replacements(self, say) -> None:
        """Replacements that finished starting join the attempt (their loss marked replaced); `say` tells."""
        for replacement in [r for r in self.replacing if r.finished]:
            self.replacing.remove(replacement)
            if replacement.handle is not None:
                replacement.loss["replaced"] = True
                self.task_of[replacement.handle] = replacement.task
                self.side.append(replacement.handle)
            say(f"raytf: {replacement.task.role} {replacement.task.index} " +
                (f"is back at {replacement.task.address}" if replacement.handle is not None
                 else f"could not be brought back ({replacement.error})"))
