"""A real MLflow tracking server on localhost for the tests: `mlflow server` (mlflow, from the package registry)
with a SQLite store and its artifact proxy in a temp folder, reached over HTTP by raytf's MLflow client as
a team's server would be.

It takes ~8 s to start (the store's migrations), so `start_in_background()` launches it early (the cluster
fixture does) and `server()` waits for it the first time a test needs it."""
from __future__ import annotations

import atexit
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 90


@dataclass
class Mlflow:
    uri: str
    root: Path

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def runs(self, experiment: str) -> list:
        """Every run of the experiment, oldest first."""
        client = self.client()
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return []
        return sorted(client.search_runs([found.experiment_id]), key=lambda r: r.info.start_time)

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in sorted(self.client().get_metric_history(run_id, key), key=lambda m: m.step)]

    def artifacts(self, run_id: str) -> list[str]:
        return sorted(a.path for a in self.client().list_artifacts(run_id))

    def download(self, run_id: str, path: str) -> Path:
        target = Path(tempfile.mkdtemp(prefix="mlflow-dl-"))
        return Path(self.client().download_artifacts(run_id, path, str(target)))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_proc: subprocess.Popen | None = None
_server: Mlflow | None = None


def start_in_background() -> None:
    global _proc, _server
    if _proc is not None:
        return
    root = Path(tempfile.mkdtemp(prefix="raytf-mlflow-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "wb")
    _proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # no background job runner: its seven huey consumers poll for jobs (a third of a core, all session long)
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    atexit.register(_stop)
    _server = Mlflow(uri=f"http://127.0.0.1:{port}", root=root)


def server() -> Mlflow:
    """The session's server, up and answering."""
    start_in_background()
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if _proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited {_proc.returncode}: "
                               f"{(_server.root / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(_server.uri + "/health", timeout=2):
                return _server
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer in {START_TIMEOUT_S} s") from None
            time.sleep(0.3)


def _stop() -> None:
    if _proc is not None and _proc.poll() is None:
        import signal

        os.killpg(_proc.pid, signal.SIGTERM)
        try:
            _proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(_proc.pid, signal.SIGKILL)
