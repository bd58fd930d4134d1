"""raytf's series for Prometheus, through Ray's own metrics API (ray.util.metrics): each Ray node's metrics
endpoint (the port in `ray.nodes()`'s MetricsExportPort) exports what the processes on that node record,
so a Prometheus that scrapes a Ray cluster gets these with Ray's own. Ray names them ray_<name>, and a
counter gets _total: ray_raytf_steps_total{run, role, rank, node}.

Per task (recorded by the task's actor, every output.metrics update; see TaskSeries) and per job (recorded
by the driver: JobSeries). Recording costs ~2.5 us a call and happens at most twice a second per task.
"""
from __future__ import annotations

import threading

TASK_TAGS = ("run", "role", "rank", "node")
JOB_TAGS = ("run",)
# Ray's default is 10 s between a value recorded and it in the endpoint; RAY_metrics_report_interval_ms,
# set where each raylet starts, shortens it (1000 is its floor).


class TaskSeries:
    """One task's series. Counters count this process's work (a restarted task's new process adds to the
    same series: sum without WorkerId in queries); gauges hold the latest value."""

    def __init__(self, run: str, role: str, rank: int, node: str):
        from ray.util import metrics

        tags = {"run": run, "role": role, "rank": str(rank), "node": node}
        self._steps = metrics.Counter("raytf_steps", "Optimizer steps the task finished.", TASK_TAGS)
        self._examples = metrics.Counter("raytf_examples", "Examples in the global batches of the task's steps "
                                                            "(rate(): the job's examples/s as this task sees it).",
                                         TASK_TAGS)
        self._input_wait = metrics.Counter("raytf_input_wait_seconds", "Time the task's steps waited for their "
                                                                       "batch (output.timing).", TASK_TAGS)
        self._step_time = metrics.Counter("raytf_step_seconds", "Time in the task's steps once their batch was "
                                                                "there: compute and all-reduce, waiting for peers "
                                                                "included (output.timing).", TASK_TAGS)
        self._global_step = metrics.Gauge("raytf_global_step", "The job's optimizer step this task is at "
                                                               "(continues across restarts).", TASK_TAGS)
        self._epoch = metrics.Gauge("raytf_epoch", "The epoch the task is in.", TASK_TAGS)
        self._loss = metrics.Gauge("raytf_loss", "The task's latest training loss.", TASK_TAGS)
        self._checkpoint = metrics.Gauge("raytf_checkpoint_seconds", "How long the task's last checkpoint took.",
                                         TASK_TAGS)
        self._phase = metrics.Gauge("raytf_task_phase", "1 for the phase the task is in (train, validating, "
                                                        "checkpointing, restoring, ...), 0 for those it left.",
                                    (*TASK_TAGS, "phase"))
        for series in (self._steps, self._examples, self._input_wait, self._step_time, self._global_step,
                       self._epoch, self._loss, self._checkpoint, self._phase):
            series.set_default_tags(tags)
        self._timed = (0.0, 0.0)  # input wait and step seconds recorded so far
        self._gauges: dict = {}  # gauge -> its latest value
        self._current_phase: str | None = None
        self._lock = threading.Lock()  # the loop's thread records, the actor's poll thread refreshes

    def stepped(self, steps: int, examples: int, global_step: int, epoch: int, loss: float | None) -> None:
        with self._lock:
            if steps > 0:
                self._steps.inc(steps)
                if examples > 0:
                    self._examples.inc(examples)
            self._gauges[self._global_step] = global_step
            self._gauges[self._epoch] = epoch
            if loss is not None and loss == loss:  # NaN is left out: the last finite loss stays
                self._gauges[self._loss] = loss
        self.refresh()

    def refresh(self) -> None:
        """Set every gauge again: Ray drops a gauge not set for two export intervals (a task validating for
        minutes would vanish). The task actor calls this whenever the driver polls it."""
        with self._lock:
            for gauge, value in self._gauges.items():
                gauge.set(value)
            if self._current_phase is not None:
                self._phase.set(1, {"phase": self._current_phase})

    def timed(self, input_wait_s: float, step_s: float) -> None:
        """The task's timing totals so far (they only grow): the counters get the difference."""
        with self._lock:
            wait_before, step_before = self._timed
            if input_wait_s > wait_before:
                self._input_wait.inc(input_wait_s - wait_before)
            if step_s > step_before:
                self._step_time.inc(step_s - step_before)
            self._timed = (max(input_wait_s, wait_before), max(step_s, step_before))

    def phase(self, name: str) -> None:
        with self._lock:
            if self._current_phase not in (None, name):
                self._phase.set(0, {"phase": self._current_phase})
            self._phase.set(1, {"phase": name})
            self._current_phase = name

    def checkpointed(self, seconds: float) -> None:
        with self._lock:
            self._gauges[self._checkpoint] = float(seconds)
            self._checkpoint.set(float(seconds))


class JobSeries:
    """The job's own series, from the driver: its state and its restarts. A thread sets the state again
    every few seconds (Ray drops a gauge not set for two export intervals, and reserving or starting may
    block the driver for minutes); close() ends it."""

    REFRESH_S = 5.0

    def __init__(self, run: str):
        from ray.util import metrics

        self._state = metrics.Gauge("raytf_job_state", "1 for the state the job is in (placing, starting, running, "
                                                       "restarting, done, failed, interrupted), 0 for those it "
                                                       "left.", (*JOB_TAGS, "state"))
        self._restarts = metrics.Counter("raytf_restarts", "Restarts of the job after a failure or a preemption "
                                                           "(a failure that ends the job is not one).", JOB_TAGS)
        for series in (self._state, self._restarts):
            series.set_default_tags({"run": run})
        self._current: str | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._keep_alive, name="raytf-job-series", daemon=True).start()

    def state(self, name: str) -> None:
        """Called at every step of the controller (each poll)."""
        with self._lock:
            if self._current not in (None, name):
                self._state.set(0, {"state": self._current})
                if self._current == "restarting" and name == "placing":  # a restart goes ahead
                    self._restarts.inc(1)
            self._state.set(1, {"state": name})
            self._current = name

    def close(self) -> None:
        self._closed.set()

    def _keep_alive(self) -> None:
        while not self._closed.wait(self.REFRESH_S):
            with self._lock:
                if self._current is not None:
                    self._state.set(1, {"state": self._current})
