"""What watches a run, as callbacks: the controller and the run's lifecycle (raytf.driver.run) call each hook
and know none of them by name.

    on_state(state)        each state the controller enters (placing, starting, running, restarting, done, ...)
    on_epoch(metrics)      each finished epoch, once and in order, across restarts
    on_end(result, error)  once, whatever ended the run; `result` is None when it ended before its controller
                           was made, `error` None when it succeeded

The terminal display stays the controller's own (it shows more than these hooks: the live step line). Ray
Tune's report is a callback of the sweep's trial (raytf.sweep_trial)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from raytf.driver.report import Result
    from raytf.job import Job


class Callback:
    """A watcher of a run; each hook does nothing unless overridden."""

    def on_state(self, state: str) -> None:
        pass

    def on_epoch(self, metrics: dict[str, Any]) -> None:
        pass

    def on_end(self, result: "Result | None", error: BaseException | None) -> None:
        pass


class TrialStopped(SystemExit):
    """A scheduler stopped the run (Ray Tune stops a trial by raising SystemExit in its report). A SystemExit
    still, so Tune ends the trial as it expects; the run's result.json says "stopped" with `reason`."""

    def __init__(self, reason: str):
        super().__init__(0)
        self.reason = reason


def end_state(error: BaseException | None) -> str:
    """The run's end, in result.json's words, from what ended it."""
    if error is None:
        return "succeeded"
    if isinstance(error, TrialStopped):
        return "stopped"
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"


def end_reason(error: BaseException) -> str:
    """result.json's `error` for a run `error` ended: the scheduler's reason, "interrupted", or the error."""
    if isinstance(error, TrialStopped):
        return error.reason
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (raytf.cli makes it one)
        return "interrupted"
    return str(error) or type(error).__name__


class PrometheusSeries(Callback):
    """The job's own Prometheus series (raytf.metrics.JobSeries): its state, liveness and restarts."""

    def __init__(self, run_name: str):
        from raytf.metrics import JobSeries

        self.series = JobSeries(run_name)

    def on_state(self, state: str) -> None:
        self.series.state(state)

    def on_end(self, result: "Result | None", error: BaseException | None) -> None:
        if error is not None:
            self.series.state(end_state(error))
        self.series.close()


class MlflowTracking(Callback):
    """The job's MLflow run (raytf.tracking): one point per epoch; result.json, the model and the end status."""

    def __init__(self, run, job: "Job"):
        self.run, self.job = run, job

    def on_epoch(self, metrics: dict[str, Any]) -> None:
        self.run.log_epoch(metrics)

    def on_end(self, result: "Result | None", error: BaseException | None) -> None:
        from raytf import tracking

        tracking.finish_job_run(self.run, self.job, result, error)


def for_job(job: "Job", say: Callable[[str], None], tracking_parent: str | None = None) -> list[Callback]:
    """The watchers a job's spec asks for: its Prometheus series (output.metrics) and its MLflow run
    (tracking.mlflow, nested in a sweep's run as `tracking_parent`). The MLflow run opens here: a server that is
    not there is an error before Ray does any work."""
    from raytf import tracking

    watchers: list[Callback] = []
    if job.spec.output.metrics:
        watchers.append(PrometheusSeries(job.spec.name))
    try:
        tracked = tracking.open_job_run(job, say, tracking_parent)
    except BaseException as exc:
        end_all(watchers, None, exc)
        raise
    if tracked is not None:
        watchers.append(MlflowTracking(tracked, job))
    return watchers


def end_all(callbacks: Sequence[Callback], result: "Result | None", error: BaseException | None) -> None:
    """Each callback's on_end, every one of them even when one raises (the first such error is raised after)."""
    failed: BaseException | None = None
    for callback in callbacks:
        try:
            callback.on_end(result, error)
        except Exception as exc:  # noqa: BLE001
            failed = failed or exc
    if failed is not None:
        raise failed
