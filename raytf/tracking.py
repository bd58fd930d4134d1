"""MLflow tracking from the spec (`tracking.mlflow`): a job is one MLflow run, logged by the process that
drives the job (`raytf run`'s, or a sweep trial's), not by the user's script: the spec as params, each
finished epoch's metrics (step = epoch), the exported model and result.json as artifacts, and the run's end
as its status. A sweep is a parent run; each trial's run is nested in it (MLflow's parentRunId tag).

The driver logs, not the chief: it sees every end of a run (a chief that died, Ctrl-C, a failed
restart), so a failed run is always marked FAILED, and the workers need no route to the server.
Once the run is open, a logging error is shown once and training goes on: result.json keeps everything.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping

from raytf.errors import RaytfError, clip

# MLflow's limits (MLflow 3): a param value of at most 6000 characters, 100 params per log_batch call.
PARAM_VALUE_LIMIT = 6000
PARAMS_PER_CALL = 100
PROBE_TIMEOUT_S = 5.0
# raytf's status -> MLflow's RunStatus name
STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "interrupted": "KILLED", "stopped": "KILLED"}
# The experiment raytf creates is a training one: MLflow 3's UI files an experiment without this tag under
# its GenAI view. Key and value as the UI's own experiment-type selector sets them ("Machine learning").
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


class TrackingUnavailable(RaytfError):
    """tracking.mlflow.uri names a server that does not answer, or MLflow refused to open the run."""


def flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested spec as MLflow params: dotted keys (the `--set` names), lists as JSON, values clipped."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name] = text[:PARAM_VALUE_LIMIT]
    return out


def epoch_metrics(metrics: Mapping[str, Any]) -> tuple[int | None, dict[str, float]]:
    """An epoch's report as (epoch, the numbers MLflow can log): flags and text left out."""
    numbers = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "epoch"}
    epoch = metrics.get("epoch")
    return (int(epoch) if isinstance(epoch, (int, float)) else None), numbers


def tracking_uri(uri: str, job_dir: Path) -> str:
    """The URI MLflow is given: a relative sqlite database is in the job folder (a sweep's trials run
    elsewhere, and must log to the same file)."""
    scheme = "sqlite:///"
    if uri.startswith(scheme) and not uri[len(scheme):].startswith("/"):
        return scheme + str((job_dir / uri[len(scheme):]).resolve())
    return uri


def sqlite_artifacts(uri: str) -> str | None:
    """A SQLite store's artifacts: beside the database (MLflow's default is ./mlruns in whatever folder the
    process happens to be in; a sweep's trials are elsewhere)."""
    scheme = "sqlite:///"
    return str(Path(uri[len(scheme):]).parent / "mlartifacts") if uri.startswith(scheme) else None


def local_store(job) -> list[Path]:
    """The files a local tracking store keeps (its database, its artifacts), for packaging to leave out."""
    section = job.spec.tracking.mlflow
    if section is None:
        return []
    uri = tracking_uri(section.uri, job.job_dir)
    artifacts = sqlite_artifacts(uri)
    return [Path(uri[len("sqlite:///"):]), Path(artifacts)] if artifacts else []


def probe(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """An http(s) tracking server answers its /health endpoint; raises TrackingUnavailable if not. Without
    this, MLflow's client retries a dead server with backoff for minutes before it says anything."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # it answered (a proxy, an auth wall): MLflow's own calls will say what is wrong
    except (OSError, ValueError) as exc:
        raise TrackingUnavailable(
            f"tracking.mlflow.uri {clip(uri)}: no MLflow server answered in {timeout_s:g} s ({exc}); start it "
            f"(e.g. mlflow server --port 5000) or remove tracking from the spec") from None


def check_server(job) -> None:
    """Before Ray starts: the job's tracking server answers (TrackingUnavailable if not)."""
    section = job.spec.tracking.mlflow
    if section is not None:
        probe(tracking_uri(section.uri, job.job_dir))


class MlflowRun:
    """One open MLflow run. `warn` shows a message (the job's display)."""

    def __init__(self, client, run_id: str, warn: Callable[[str], None]):
        self.client, self.run_id, self.warn = client, run_id, warn
        # After one failed call, only the run's end is still tried: each call to a server gone away waits
        # out MLflow's timeout, in the driver's poll (it would delay the hang watchdog and drain deadlines).
        self._broken = False

    @classmethod
    def open(cls, uri: str, experiment: str, run_name: str, params: Mapping[str, str], *,
             parent_run_id: str | None = None, tags: Mapping[str, str] | None = None,
             warn: Callable[[str], None] = print) -> "MlflowRun":
        """Create the run (and the experiment if missing) and log its params; TrackingUnavailable if the
        server is not there or refuses."""
        # A dead server must not hold a job for minutes in MLflow's retries (the user can still set these).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        probe(uri)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        try:
            client = MlflowClient(tracking_uri=uri)
            experiment_id = _experiment_id(client, experiment, sqlite_artifacts(uri))
            all_tags = {"raytf.run": run_name, **(tags or {})}
            if parent_run_id:
                all_tags["mlflow.parentRunId"] = parent_run_id
            run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), PARAMS_PER_CALL):
                client.log_batch(run.info.run_id, params=items[i:i + PARAMS_PER_CALL])
        except Exception as exc:
            raise TrackingUnavailable(f"tracking.mlflow ({clip(uri)}): could not open a run in experiment "
                                      f"{experiment!r}: {clip(str(exc))}") from None
        return cls(client, run.info.run_id, warn)

    def log_epoch(self, metrics: Mapping[str, Any]) -> None:
        epoch, numbers = epoch_metrics(metrics)
        if not numbers:
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self._try(lambda: self.client.log_batch(self.run_id, metrics=[
            Metric(k, v, stamp, epoch or 0) for k, v in numbers.items()]))

    def log_artifacts(self, paths: list[Path]) -> None:
        """Files go to the run's artifact root by name; folders (a SavedModel) as a folder of that name."""
        for path in paths:
            if path.is_dir():
                self._try(lambda p=path: self.client.log_artifacts(self.run_id, str(p), artifact_path=p.name))
            elif path.is_file():
                self._try(lambda p=path: self.client.log_artifact(self.run_id, str(p)))

    def end(self, status: str) -> None:
        """`status`: raytf's (succeeded, failed, interrupted, stopped: by a sweep's scheduler)."""
        self._broken = False
        self._try(lambda: self.client.set_terminated(self.run_id, status=STATUS.get(status, "FAILED")))

    def end_children(self) -> None:
        """Nested runs still RUNNING end KILLED: a scheduler stops a trial by ending its process, which
        leaves its run no chance to say so."""
        def close() -> None:
            experiment = self.client.get_run(self.run_id).info.experiment_id
            children = self.client.search_runs([experiment], f"tags.mlflow.parentRunId = '{self.run_id}' "
                                                             f"and attributes.status = 'RUNNING'")
            for child in children:
                self.client.set_terminated(child.info.run_id, status="KILLED")
        self._try(close)

    def _try(self, call: Callable[[], Any]) -> None:
        if self._broken:
            return
        try:
            call()
        except Exception as exc:
            self._broken = True
            self.warn(f"raytf: tracking.mlflow: {clip(str(exc))}; MLflow is left out from here, training goes on "
                      f"(result.json keeps the run)")


def _experiment_id(client, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id; one that is not there is created, tagged as a training experiment (one that
    is keeps its tags: its kind may be the user's choice)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location, tags=EXPERIMENT_KIND)
    except Exception:  # another trial made it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def open_job_run(job, warn: Callable[[str], None], parent_run_id: str | None = None) -> MlflowRun | None:
    """The job's run, if its spec asks for one (None if not)."""
    section = job.spec.tracking.mlflow
    if section is None:
        return None
    params = flat_params(job.spec.model_dump(mode="json"))
    return MlflowRun.open(tracking_uri(section.uri, job.job_dir), section.experiment or job.spec.name,
                          job.spec.name, params, parent_run_id=parent_run_id,
                          tags={"raytf.output_dir": job.output_where}, warn=warn)


def finish_job_run(run: MlflowRun | None, job, result, error: BaseException | None = None) -> None:
    """The run's artifacts (result.json, if written; the exported model on success) and its status. No
    result: the job ended before its controller ran (`error` says how)."""
    if run is None:
        return
    out = job.output_dir
    paths = [out / "result.json"]
    if result is None:
        run.log_artifacts(paths)
        run.end("interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
        return
    if result.status == "succeeded":
        prefix = job.output_where.rstrip("/") + "/"
        paths += [out / loc[len(prefix):] for loc in result.exports.values() if loc.startswith(prefix)]
    run.log_artifacts(paths)
    run.end(result.status)


def open_sweep_run(prepared, warn: Callable[[str], None]) -> MlflowRun | None:
    """A sweep's parent run: the base spec and the tune section as params; its trials' runs nest in it."""
    base = prepared.base
    section = base.spec.tracking.mlflow
    if section is None:
        return None
    params = {**flat_params(base.spec.model_dump(mode="json")),
              **flat_params(prepared.section.model_dump(mode="json"), "tune.")}
    return MlflowRun.open(tracking_uri(section.uri, base.job_dir), section.experiment or base.spec.name,
                          base.spec.name, params, tags={"raytf.output_dir": prepared.output_where, "raytf.kind": "sweep"},
                          warn=warn)


def finish_sweep_run(run: MlflowRun | None, out: Path, status: str) -> None:
    """sweep.json, sweep.png and best.yaml (those written) as artifacts, and the sweep's end as its status."""
    if run is None:
        return
    run.log_artifacts([out / name for name in ("sweep.json", "sweep.png", "best.yaml")])
    run.end_children()
    run.end(status)
