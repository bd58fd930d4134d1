"""tracking.mlflow without a cluster: what the spec becomes in MLflow, and every way the section can be wrong.
The runs themselves are checked against a real MLflow server by cluster tests (test_cluster.py: a job and a
failed job; test_user_paths.py: a sweep's nested runs)."""
import json
import os
import subprocess
import time

import pytest

from raytf import tracking
from raytf.errors import SpecError
from raytf.job import load, parse
from tests.conftest import base_spec, write_job
from tests.fakes import NO_CODE

pytestmark = pytest.mark.timeout(60)


def test_the_spec_becomes_params_under_its_set_names_and_an_epoch_becomes_numbers_at_its_step():
    spec = parse(base_spec(train={"epochs": 3}, metrics=["accuracy"]))
    params = tracking.flat_params(spec.model_dump(mode="json"))
    assert params["train.epochs"] == "3" and params["optimizer.name"] == "adam"  # the keys `--set` takes
    assert params["metrics"] == '["accuracy"]' and params["checkpoint.dir"] == "null"
    assert all(len(v) <= tracking.PARAM_VALUE_LIMIT for v in tracking.flat_params({"config": {"x": "y" * 9000}}).values())

    epoch, numbers = tracking.epoch_metrics({"epoch": 2, "loss": 0.5, "val_accuracy": 0.9, "nonfinite": True,
                                             "note": "text"})
    assert (epoch, numbers) == (2, {"loss": 0.5, "val_accuracy": 0.9})


def test_a_relative_sqlite_store_is_in_the_job_folder_and_servers_are_left_as_given(tmp_path):
    assert tracking.tracking_uri("sqlite:///mlflow.db", tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking.tracking_uri("sqlite:////abs/m.db", tmp_path) == "sqlite:////abs/m.db"
    assert tracking.tracking_uri("http://mlflow:5000", tmp_path) == "http://mlflow:5000"


@pytest.mark.parametrize("uri", ["https://me:s3cret@mlflow.example.com", "http://u:p@10.0.0.1:5000/"])
def test_a_password_in_the_uri_is_refused_without_repeating_it(uri):
    with pytest.raises(SpecError) as raised:
        parse(base_spec(tracking={"mlflow": {"uri": uri}}))
    message = str(raised.value)
    assert "tracking.mlflow.uri" in message and "MLFLOW_TRACKING_PASSWORD" in message
    assert "s3cret" not in message and ":p@" not in message


def test_tracking_without_mlflow_installed_is_a_spec_error_naming_the_extra(job_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    path = write_job(job_dir, base_spec(tracking={"mlflow": {"uri": "http://127.0.0.1:5000"}}))
    with pytest.raises(SpecError, match=r"tracking\.mlflow: .*pip install 'raytf\[mlflow\]'"):
        load(path, check_data=False, check_code=False)


def test_a_tracking_server_that_is_not_there_is_exit_1_before_ray_starts(job_dir):
    with __import__("socket").socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = write_job(job_dir, base_spec(tracking={"mlflow": {"uri": f"http://127.0.0.1:{port}"}}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.monotonic()
    proc = subprocess.run(["raytf", "run", str(path)], cwd=job_dir, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"raytf: error: tracking.mlflow.uri http://127.0.0.1:{port}: no MLflow server answered in 5 s "
                     f"(<urlopen error [Errno 111] Connection refused>); start it (e.g. mlflow server --port 5000) or "
                     f"remove tracking from the spec"], proc.stderr
    assert not (job_dir / "runs").exists()  # nothing written, no Ray started
    assert "Started a local Ray" not in proc.stderr and time.monotonic() - started < 30


class RecordedRun:
    """Stands in for an open MLflow run at the tracking seam."""

    def __init__(self):
        self.calls = []

    def log_epoch(self, metrics):
        self.calls.append(("epoch", metrics.get("epoch")))

    def log_artifacts(self, paths):
        self.calls.append(("artifacts", sorted(p.name for p in paths if p.exists())))

    def end(self, status):
        self.calls.append(("end", status))


@pytest.mark.parametrize("raised,status", [(KeyboardInterrupt(), "interrupted"), (OSError("upload refused"), "failed")])
def test_a_run_that_ends_before_its_controller_runs_is_closed_with_its_status(job_dir, monkeypatch, raised, status):
    """The run's lifecycle (raytf.driver.run) closes result.json and the MLflow run whatever ends it, here the
    job folder's upload or the controller's set-up, before any attempt."""
    from raytf.driver import controller, run, session
    from raytf.driver.report import ProgressDisplay

    recorded = RecordedRun()
    monkeypatch.setattr(tracking, "open_job_run", lambda job, say, parent=None: recorded)
    monkeypatch.setattr(session, "cluster_identity", lambda: {"session": "s", "address": "a"})

    def refuse(*args, **kwargs):
        raise raised

    monkeypatch.setattr(controller, "start", refuse)
    job = load(write_job(job_dir, base_spec(tracking={"mlflow": {"uri": "http://127.0.0.1:9"}})), check_code=False)
    with pytest.raises(type(raised)):
        run.execute(job, resume=False, display=ProgressDisplay(quiet=True), code=NO_CODE)
    written = json.loads((job.output_dir / "result.json").read_text())
    assert written["status"] == status and written["attempts"][0]["ended_because"].startswith(status)
    assert recorded.calls == [("artifacts", ["result.json"]), ("end", status)]  # the closed result.json logged
