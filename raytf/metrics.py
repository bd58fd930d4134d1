"""raytf's series for Prometheus, through Ray's own metrics API (ray.util.metrics): each Ray node's metrics
endpoint (the port in `ray.nodes()`'s MetricsExportPort) exports what the processes on that node record,
so a Prometheus that scrapes a Ray cluster gets these with Ray's own. Ray names them ray_<name>, and a
counter gets _total: ray_raytf_steps_total{run, role, rank, node}.

Per task (recorded by the task's actor, every output.metrics update; see TaskSeries) and per job (recorded
by the driver: JobSeries). Recording costs ~2.5 us a call and happens at most twice a second per task, plus
the keep-alive below.

How Ray 2.60 carries a gauge (measured): a process exports what it set since its last export, every
RAY_metrics_report_interval_ms (its own setting: 10 s by default, 1 s at the least), and the node's metrics
agent keeps a gauge for two of *its* intervals after the last export that carried it, then drops it. So
every gauge is set again several times per export interval of the process that records it (a keep-alive
thread; a task validating for minutes, a driver blocked reserving, a restart would vanish otherwise), a
driver joining a cluster exports every second (`driver_exports_every_second`: the cluster's nodes may keep
a gauge only 2 s), and a series ends by itself once nothing sets it. Counters never end (the agent keeps
them while the node lives, also for a process gone): the job's `live` gauge says which runs are live, and
the dashboard's panels keep only those.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

TASK_TAGS = ("run", "role", "rank", "node")
JOB_TAGS = ("run",)
EXPORT_INTERVAL_VAR = "RAY_metrics_report_interval_ms"
ENDED = ("done", "failed", "interrupted", "stopped")  # job states after which the run is not live (stopped: by a
# sweep's scheduler)
SETS_PER_EXPORT = 4  # the keep-alive sets every gauge this often per export interval


def driver_exports_every_second(environ=os.environ) -> None:
    """Before a driver's ray.init joins a cluster: its own series go out every second (Ray's floor) unless
    RAY_metrics_report_interval_ms says otherwise. The cluster's nodes may have been started with the README's
    `RAY_metrics_report_interval_ms=1000`, and then keep a gauge 2 s: a driver exporting at Ray's default 10 s
    would be seen 2 s in 10 (the job state was). The variable is this process's only (the nodes' raylets and
    the tasks keep the cluster's); an export is a few series over a local connection."""
    environ.setdefault(EXPORT_INTERVAL_VAR, "1000")


def export_interval_s() -> float:
    """How often this process exports its series: its RAY_metrics_report_interval_ms as Ray resolved it
    (environment or the cluster's system config), 1 s at the least as Ray floors it; 10 s, Ray's default,
    where Ray cannot say (no Ray in this process yet)."""
    try:
        import ray

        ms = float(ray._config.metrics_report_interval_ms())  # Ray-private; raytf pins Ray 2.60.*
    except Exception:  # noqa: BLE001 -- a moved or missing accessor: assume Ray's default
        ms = 10_000.0
    return max(ms, 1000.0) / 1000.0


class _KeepAlive:
    """Calls `refresh` every `period_s` in a daemon thread until stop(). A refresh that raises stops it (said
    once, as a task's channel does): metrics never stop the work they describe."""

    def __init__(self, name: str, refresh: Callable[[], None], period_s: float):
        self._refresh, self._period_s = refresh, period_s
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            try:
                self._refresh()
            except Exception as exc:  # noqa: BLE001
                print(f"raytf: output.metrics keep-alive stopped: {type(exc).__name__}: {exc}", flush=True)
                return


class TaskSeries:
    """One task's series. Counters count this process's work (a restarted task's new process adds to the
    same series: sum without WorkerId in queries); gauges hold the latest value, set again by a keep-alive
    thread several times per export interval whatever the task does, until close() (the task's job is
    over in this process: its gauges then end within two export intervals).

    `role`: as the run's summary names it (rank 0 of a mirrored job is its `chief`). The phase is
    `starting` from the series' making (the task's setup) until the loop names one."""

    def __init__(self, run: str, role: str, rank: int, node: str, interval_s: float | None = None):
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
        self._phase = metrics.Gauge("raytf_task_phase", "1 for the phase the task is in (starting, train, "
                                                        "validating, checkpointing, restoring, ...), 0 for those "
                                                        "it left.", (*TASK_TAGS, "phase"))
        for series in (self._steps, self._examples, self._input_wait, self._step_time, self._global_step,
                       self._epoch, self._loss, self._checkpoint, self._phase):
            series.set_default_tags(tags)
        self._timed = (0.0, 0.0)  # input wait and step seconds recorded so far
        self._gauges: dict = {}  # gauge -> its latest value
        self._current_phase: str | None = None
        self._closed = False
        self._lock = threading.Lock()  # the loop's thread records, the actor's poll thread and the keep-alive refresh
        self.phase("starting")
        period = (interval_s or export_interval_s()) / SETS_PER_EXPORT
        self._keep_alive = _KeepAlive(f"raytf-task-series-{rank}", self.refresh, period)

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
        """Set every gauge again: Ray drops a gauge not set for two export intervals. The keep-alive calls
        this, and the task actor whenever the driver polls it (not once closed)."""
        with self._lock:
            if self._closed:
                return
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

    def close(self) -> None:
        """The task's job is over in this process: nothing sets its gauges again (Ray drops them)."""
        with self._lock:
            self._closed = True
        self._keep_alive.stop()


class JobSeries:
    """The job's own series, from the driver: its state, whether it is live, its restarts.

    `ray_raytf_job_state{state}` is 1 for the state the job is in: placing (from the series' making: the
    upload and the reservation), starting, running, restarting (from a failure until the new attempt runs:
    its placing and starting are shown as restarting), then done, failed, interrupted or stopped (a sweep's
    scheduler stopped the trial). `ray_raytf_job_live`
    is 1 from the making until close(), then 0 until Ray drops it. `ray_raytf_restarts_total` is there from
    the start at 0. A keep-alive thread sets the gauges again several times per export interval (reserving
    or starting may block the driver for minutes); close() ends it, and Ray drops the gauges within two
    export intervals after."""

    def __init__(self, run: str, interval_s: float | None = None):
        from ray.util import metrics

        self._state = metrics.Gauge("raytf_job_state", "1 for the state the job is in (placing, starting, running, "
                                                       "restarting, done, failed, interrupted, stopped), 0 for "
                                                       "those it left.", (*JOB_TAGS, "state"))
        self._live = metrics.Gauge("raytf_job_live", "1 while the run's driver runs it, 0 once it ended (then the "
                                                     "series ends): the dashboard shows the live runs' series.",
                                   JOB_TAGS)
        self._restarts = metrics.Counter("raytf_restarts", "Restarts of the job after a failure or a preemption "
                                                           "(a failure that ends the job is not one).", JOB_TAGS)
        for series in (self._state, self._live, self._restarts):
            series.set_default_tags({"run": run})
        self._lock = threading.Lock()
        self._current: str | None = None  # the controller's state
        self._shown: str | None = None  # the state the series show
        self._restarting = False
        self._is_live = 1
        # Present as 0 from the start (a panel then says 0, and increase() sees the first restart). Counter.inc
        # refuses 0; the record underneath takes it (Ray-private, raytf pins Ray 2.60.*; without it: absent).
        try:
            self._restarts._record(0)
        except Exception:  # noqa: BLE001
            pass
        self.state("placing")
        self._keep_alive = _KeepAlive("raytf-job-series", self._refresh,
                                      (interval_s or export_interval_s()) / SETS_PER_EXPORT)

    def state(self, name: str) -> None:
        """Called at every step of the controller (each poll)."""
        with self._lock:
            if self._current == "restarting" and name == "placing":  # a restart goes ahead
                self._restarts.inc(1)
            if name == "restarting":
                self._restarting = True
            elif name not in ("placing", "starting"):
                self._restarting = False
            self._current = name
            shown = "restarting" if self._restarting else name
            if self._shown not in (None, shown):
                self._state.set(0, {"state": self._shown})
            self._state.set(1, {"state": shown})
            self._shown = shown
            if name in ENDED:
                self._is_live = 0
            self._live.set(self._is_live)

    def close(self) -> None:
        """The run is over: live 0, and nothing sets the gauges again."""
        with self._lock:
            self._is_live = 0
            self._live.set(0)
        self._keep_alive.stop()

    def _refresh(self) -> None:
        with self._lock:
            self._state.set(1, {"state": self._shown})
            self._live.set(self._is_live)
