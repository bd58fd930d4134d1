"""A task's channel to the driver: what the task actor answers when polled (Progress: phase, step, rate, CPU
time, epochs so far) and the drain notice's stop request, read from another thread of the actor while the
loop runs. raytf's loops and the user's ctx (raytf.actor.context) report into it; only the task actor and
the loops hold it. No TensorFlow here.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable

from raytf.protocol import Progress, StopAnswer


class TaskChannel:
    def __init__(self, rank: int, full_update_s: float = 0.5, series=None):
        """`series`: the task's Prometheus series (raytf.metrics.TaskSeries), updated with each full update."""
        self._lock = threading.Lock()
        self._series = series
        self._counted_to = 0  # the global step the series have counted up to (a restore's, at first)
        self._batch = 0  # examples per step, as the last step said
        self._series_failed = False
        # set by the loop when it times its steps: () -> {"input_wait_s", "step_s", ...} so far, or None
        self.timing_source: Callable[[], dict[str, Any] | None] | None = None
        self._full_update_s = full_update_s  # between steps' full updates (loss, rate); the step itself always
        self._last_full = (0.0, 0)  # (when, global step) of the last full update
        self._progress = Progress(rank=rank, pid=os.getpid(), updated=time.time())
        self._epochs: list[dict[str, Any]] = []
        self._evaluations: list[dict[str, Any]] = []
        self._stop_at: int | None = None  # a drain notice: the step the loop stops and checkpoints at
        self.stop_requested_at: float | None = None
        self._last_step = 0  # the last step the loop finished, as stop_due saw it
        self.first_step_at: float | None = None  # the Outcome's: when training was under way

    # -- a drain notice (raytf.driver.drain): every loop-running rank stops at one common step
    def request_stop(self, step: int) -> StopAnswer:
        """Stop after optimizer step `step`. Accepted only while the loop has not finished it yet (it may
        be inside the step after the last one it finished), so every rank that accepts stops at exactly
        `step`; the driver gives up on the checkpoint when one does not accept."""
        with self._lock:
            accepted = step > self._last_step
            if accepted:
                self._stop_at, self.stop_requested_at = step, time.time()
            return StopAnswer(accepted, self._last_step)

    def stop_due(self, step: int) -> bool:
        """Called by the loop after each optimizer step (`step`: done so far): whether to stop here."""
        with self._lock:
            self._last_step = step
            return self._stop_at is not None and step >= self._stop_at

    @property
    def stop_requested(self) -> bool:
        return self._stop_at is not None

    def checkpointed(self, seconds: float) -> None:
        """How long the last checkpoint took: the driver compares it with a draining node's deadline."""
        with self._lock:
            self._progress = dataclasses.replace(self._progress, checkpoint_s=round(seconds, 3))
        self._to_series(lambda: self._series.checkpointed(seconds))

    # -- progress, called on every step; cheap unless a full update is due
    def train_step(self, epoch: int, step: int, steps: int | None, global_step: int, loss, examples: int) -> None:
        now = time.time()
        if self.first_step_at is None:
            self.first_step_at = now
        self._batch = examples
        if now - self._last_full[0] < self._full_update_s and step != steps:
            with self._lock:
                self._progress = dataclasses.replace(self._progress, global_step=global_step, updated=now)
            return
        (then, step_then), self._last_full = self._last_full, (now, global_step)
        rate = (global_step - step_then) / (now - then) if then and now > then else None
        with self._lock:
            self._progress = dataclasses.replace(
                self._progress, phase="train", epoch=epoch, step=step, steps=steps, global_step=global_step,
                loss=float("nan") if loss is None else float(loss), examples_seen=examples * global_step, updated=now,
                # since the last full update: a drain's stop step
                steps_per_s=round(rate, 2) if rate is not None else self._progress.steps_per_s)
        self._record(epoch, global_step, loss, examples)

    def start_at(self, global_step: int) -> None:
        """The step training starts from (0, or a restored checkpoint's): the series count the steps after it."""
        self._counted_to = int(global_step)

    def _record(self, epoch: int, global_step: int, loss, examples: int) -> None:
        """Steps counted from the global step, not from calls: a train_fn may say its step once an epoch."""
        steps = max(0, int(global_step) - self._counted_to)
        self._counted_to = max(self._counted_to, int(global_step))

        def record():
            self._series.stepped(steps, steps * examples, int(global_step), int(epoch),
                                 None if loss is None else float(loss))
            self._series.phase("train")
            timing = self.timing_source() if self.timing_source is not None else None
            if timing:
                self._series.timed(timing["input_wait_s"], timing["step_s"])
        self._to_series(record)

    def _to_series(self, call: Callable[[], None]) -> None:
        """Metrics never stop training: a failing call is said once (in the task's log) and they stop."""
        if self._series is None or self._series_failed:
            return
        try:
            call()
        except Exception as exc:
            self._series_failed = True
            print(f"raytf: rank {self._progress.rank}: output.metrics stopped: {type(exc).__name__}: {exc}", flush=True)

    def work_done(self) -> None:
        """A unit of work finished that is not an optimizer step this task took (a parameter-server worker
        ran a function the chief's train_fn scheduled): progress for the hang watchdog."""
        with self._lock:
            self._progress = dataclasses.replace(self._progress, work_done=self._progress.work_done + 1)

    def phase(self, name: str) -> None:
        """A named stretch of work (validating, checkpointing, restoring): progress for the hang watchdog."""
        with self._lock:
            self._progress = dataclasses.replace(self._progress, phase=name, updated=time.time())
        self._last_full = (0.0, 0)  # steps_per_s starts over after this: it measures stepping only
        self._to_series(lambda: self._series.phase(name))

    def epoch_end(self, metrics: dict[str, Any]) -> None:
        if self.first_step_at is None:  # a train_fn that reports epochs and no step
            self.first_step_at = time.time()
        with self._lock:
            self._epochs.append(dict(metrics))
            self._progress = dataclasses.replace(self._progress, phase="epoch_end", updated=time.time())
        self._last_full = (0.0, 0)
        if self._series is not None:
            p = self._progress
            if p.global_step > self._counted_to:  # steps since the last full update (a train_fn's last ones)
                self._record(p.epoch or 0, p.global_step, p.loss, self._batch)
            self._to_series(lambda: self._series.phase("epoch_end"))

    def evaluation(self, metrics: dict[str, Any]) -> None:
        """The evaluator side-car's result for one checkpoint."""
        with self._lock:
            self._evaluations.append(dict(metrics))
            self._progress = dataclasses.replace(self._progress, phase="evaluated", updated=time.time())

    def end_series(self) -> None:
        """The task's job is over in this process: its series' keep-alive stops (raytf.metrics.TaskSeries)."""
        if self._series is not None:
            self._series.close()

    def progress(self) -> Progress:
        """The latest step, and every epoch's metrics so far (so a slow poller misses none)."""
        self._to_series(lambda: self._series.refresh())
        with self._lock:
            return dataclasses.replace(self._progress, epochs=tuple(self._epochs), evaluations=tuple(self._evaluations),
                                       cpu_s=time.process_time())
