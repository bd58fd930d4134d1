"""A real Ray head for tests: `ray start --head --block` with its dashboard (the Jobs API), token
authentication on, its own ports and --temp-dir, in its own process group.

Tearing it down kills exactly the processes it started (the group, plus strays of this cluster found by
its temp dir or RAY_ADDRESS), never `ray stop`, which would stop every Ray on the machine."""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from raytf.driver.session import EMBEDDED_RAY_CONFIG
import requests

BIN = Path(sys.executable).parent  # `ray` and `raytf` of this environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Head:
    address: str  # the Jobs API: http://127.0.0.1:<dashboard port>
    gcs_address: str
    env: dict  # RAY_AUTH_MODE=token and the token: what a user's shell has
    temp_dir: str
    proc: subprocess.Popen = field(repr=False)  # `ray start --block`


# The test heads' nodes prestart no idle Python workers, as raytf's embedded Ray: its settings, as Ray reads them
# from a node's environment
NO_PRESTART_ENV = {f"RAY_{key}": str(int(value)) for key, value in EMBEDDED_RAY_CONFIG.items()}


def start_head(extra_args=(), extra_env=None, autoscaling_config=None, ready_timeout_s=120):
    """`ray start --head --block` in a new process group; returns (Head, Popen, log path).

    `autoscaling_config`: a cluster config for the head's autoscaler; its provider's gcs_address is
    filled in (the fake multi-node provider otherwise assumes port 6379)."""
    temp_dir = tempfile.mkdtemp(prefix="rtf", dir="/tmp")  # short: Ray's unix sockets live under it
    gcs_port, dash_port = free_port(), free_port()
    gcs_address = f"{_node_ip()}:{gcs_port}"
    if autoscaling_config is not None:
        config = json.loads(json.dumps(autoscaling_config))
        config["provider"]["gcs_address"] = gcs_address
        config_path = Path(temp_dir) / "autoscaling.json"
        config_path.write_text(json.dumps(config))
        extra_args = [*extra_args, f"--autoscaling-config={config_path}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "TF_CPP_MIN_LOG_LEVEL": "2",
                "RAY_USAGE_STATS_ENABLED": "0", **NO_PRESTART_ENV, **(extra_env or {})})
    log_path = Path(temp_dir) / "ray-start.log"
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs_port}", f"--dashboard-port={dash_port}",
           "--include-dashboard=true", f"--temp-dir={temp_dir}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--metrics-export-port={free_port()}", "--disable-usage-stats", *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(address=f"http://127.0.0.1:{dash_port}", gcs_address=gcs_address, env=env, temp_dir=temp_dir,
                proc=proc)
    deadline = time.time() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
        if head_answers(head):
            return head, proc, log_path
        if time.time() > deadline:
            stop_head(proc, head)
            pytest.fail(f"the Ray head's Jobs API did not come up in {ready_timeout_s}s: {log_path.read_text()[-3000:]}")
        time.sleep(1)


def head_answers(head: Head) -> bool:
    """Whether the head still runs and its Jobs API answers. (A head can be broken and still running:
    with its raylet killed, `ray start --block` has been seen not to exit for over 30 s.)"""
    if head.proc.poll() is not None:
        return False
    try:
        return requests.get(f"{head.address}/api/version", timeout=5,
                            headers={"Authorization": f"Bearer {head.env['RAY_AUTH_TOKEN']}"}).ok
    except requests.RequestException:
        return False


def head_report(head: Head, limit: int = 1500) -> str:
    """Why a test's head went away: whether `ray start --block` still runs, and the last lines of the logs
    that name the cause. `--block` ends the whole head when any Ray process exits unexpectedly; the raylet
    exits when its agents die or stop answering (ray-project/ray#66153)."""
    state = "running" if head.proc.poll() is None else f"exited with {head.proc.returncode}"
    parts = [f"the test's Ray head ({head.address}, temp dir {head.temp_dir}): `ray start --block` {state}"]
    logs = Path(head.temp_dir) / "session_latest" / "logs"
    for path in (Path(head.temp_dir) / "ray-start.log", logs / "ray_process_exit.log", logs / "raylet.out",
                 logs / "dashboard.err", logs / "dashboard_agent.log", logs / "runtime_env_agent.log",
                 logs / "gcs_server.out"):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        if path.name not in ("ray-start.log", "ray_process_exit.log", "dashboard.err"):  # long: errors only
            lines = [line for line in lines if " E " in line or "ERROR" in line or "exit" in line.lower()]
        text = "\n".join(lines)[-limit:]
        if text.strip():
            parts.append(f"--- {path.name}:\n{text}")
    return "\n".join(parts)


def _node_ip() -> str:
    from ray._private.services import get_node_ip_address

    return get_node_ip_address()


def stop_head(proc: subprocess.Popen, head: Head) -> None:
    """SIGTERM the head's process group (every Ray process it started, and the autoscaler's fake nodes),
    then SIGKILL what is left; also any stray process of this cluster outside that group (a job's driver
    runs in its own session), found by the cluster's temp dir in its command line or its RAY_ADDRESS."""
    import ray  # noqa: F401  (puts its vendored psutil on sys.path)
    import psutil

    with_marker = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
            environ = p.info["environ"] or {}
        except (psutil.Error, TypeError):
            continue
        if p.pid != os.getpid() and (head.temp_dir in cmdline or environ.get("RAY_ADDRESS") == head.gcs_address):
            with_marker.append(p)
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):  # a test's cluster: no state to save
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for p in with_marker:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if proc.poll() is not None and not any(map(_running, with_marker)) and not group_alive(proc.pid):
                shutil.rmtree(head.temp_dir, ignore_errors=True)
                return
            time.sleep(0.5)


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies, already dead, do not count)."""
    return bool(group_pids(pgid))


def group_pids(pgid: int) -> list[int]:
    """The processes of the group that still run (zombies, already dead, do not count)."""
    import ray  # noqa: F401  (puts its vendored psutil on sys.path)
    import psutil

    pids = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return pids


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (its direct children)."""
    import ray  # noqa: F401  (puts its vendored psutil on sys.path)
    import psutil

    return [child.pid for child in psutil.Process(pid).children()]


def still_running(pids: list[int], wait_s: float) -> list[int]:
    """Those of `pids` still running after up to `wait_s` (zombies count as gone)."""
    import ray  # noqa: F401  (puts its vendored psutil on sys.path)
    import psutil

    def running(pid: int) -> bool:
        try:
            return _running(psutil.Process(pid))
        except psutil.Error:
            return False

    deadline = time.time() + wait_s
    while (left := [pid for pid in pids if running(pid)]) and time.time() < deadline:
        time.sleep(0.1)
    return left
