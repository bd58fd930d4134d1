"""Hosts with their own addresses on one machine: Linux network namespaces on a bridge, each running its own
Ray node (`ray start`, token auth on, a temp dir per host), the head's GCS and Jobs API on the head's address.

Everything is torn down by what it is, never by process name: each namespace's processes (`ip netns pids`),
the `ray start` process groups, the veth pairs, the namespaces and the bridge. Needs root and iproute2;
`why_not()` says why namespaces cannot be made here, for a skip.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.ray_head import NO_PRESTART_ENV

BIN = Path(sys.executable).parent  # `ray` and `raytf` of this environment
GCS_PORT, JOBS_PORT = 6379, 8265


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def why_not() -> str | None:
    """None when network namespaces can be made here; else the reason."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"rtfprobe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _unused_tag() -> str:
    """A name part no link or namespace on this machine has yet: two harnesses alive in one process (a module's
    cluster and a test's own) once drew the same pid-based tag and the bridge existed ("File exists")."""
    taken = ip("link", "show", check=False).stdout + ip("netns", "list", check=False).stdout
    while True:
        tag = secrets.token_hex(3)  # "rtf" + 6 + "v9" stays within Linux's 15-character interface names
        if f"rtf{tag}" not in taken and f"rtfb{tag}" not in taken:
            return tag


def _unused_subnet() -> str:
    """A 10.x.y.0/24 no interface here is on."""
    taken = ip("-o", "-4", "addr", "show", check=False).stdout
    while True:
        subnet = f"10.{random.randrange(16, 250)}.{random.randrange(1, 250)}"
        if f" {subnet}." not in taken:
            return subnet


@dataclasses.dataclass
class Host:
    name: str
    ns: str
    address: str
    veth: str  # its end on the bridge, in the root namespace
    temp_dir: str
    proc: subprocess.Popen | None = None  # `ray start --block`, in its own process group


class Hosts:
    """A bridge (the root namespace keeps its .1 address, so tests reach the head from outside) and one
    namespace per host, .10 upwards, each with a Ray node."""

    def __init__(self, names: list[str], cpus: dict[str, float], gpus: dict[str, int]):
        self.tag, self.subnet = _unused_tag(), _unused_subnet()
        self.bridge = f"rtfb{self.tag}"
        self.root = tempfile.mkdtemp(prefix="rtfn", dir="/tmp")  # short: Ray's unix sockets live under it
        self.token = secrets.token_hex(32)
        self.hosts = {name: Host(name, f"rtf{self.tag}-{name}", f"{self.subnet}.{10 + i}", f"rtf{self.tag}v{i}",
                                 os.path.join(self.root, name)) for i, name in enumerate(names)}
        self.cpus, self.gpus = cpus, gpus
        self.logs: dict[str, Path] = {}
        self.cut: set[str] = set()  # hosts whose cable a test pulled and nobody put back

    # ---------------------------------------------------------------- the network
    def make_network(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for h in self.hosts.values():
            ip("netns", "add", h.ns)
            ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            ip("link", "set", h.veth, "master", self.bridge)
            ip("link", "set", h.veth, "up")
            ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            ip("-n", h.ns, "link", "set", "eth0", "up")
            ip("-n", h.ns, "link", "set", "lo", "up")
            ip("-n", h.ns, "route", "add", "default", "via", f"{self.subnet}.1")

    def link(self, name: str, up: bool) -> None:
        """The host's cable: its veth on the bridge up or down (processes keep running)."""
        ip("link", "set", self.hosts[name].veth, "up" if up else "down")
        (self.cut.discard if up else self.cut.add)(name)

    # ---------------------------------------------------------------- Ray
    @property
    def head(self) -> Host:
        return next(iter(self.hosts.values()))

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    @property
    def jobs_address(self) -> str:
        return f"http://{self.head.address}:{JOBS_PORT}"

    def env(self) -> dict[str, str]:
        """A user's shell for this cluster: the token, nothing pointing at another Ray."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0",
                   PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="2", **NO_PRESTART_ENV)
        return env

    def start_ray(self, ready_timeout_s: float = 90) -> None:
        for i, h in enumerate(self.hosts.values()):
            os.makedirs(h.temp_dir, exist_ok=True)
            self._ray_start(h, head=i == 0)
            if i == 0:
                self._wait_for_nodes(1, ready_timeout_s)
        self._wait_for_nodes(len(self.hosts), ready_timeout_s)

    def _ray_start(self, h, head: bool) -> None:
        args = ["--head", f"--port={GCS_PORT}", f"--dashboard-host={h.address}", f"--dashboard-port={JOBS_PORT}",
                "--include-dashboard=true"] if head else [f"--address={self.gcs_address}"]
        cmd = ["ip", "netns", "exec", h.ns, str(BIN / "ray"), "start", "--block", *args,
               f"--node-ip-address={h.address}", f"--temp-dir={h.temp_dir}", f"--num-cpus={self.cpus[h.name]:g}",
               f"--num-gpus={self.gpus.get(h.name, 0)}", "--disable-usage-stats"]
        self.logs[h.name] = Path(self.root) / f"{h.name}.log"
        with open(self.logs[h.name], "a") as log:
            h.proc = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def _wait_for_nodes(self, count: int, timeout_s: float, starts: int = 3) -> None:
        """Until `count` nodes are alive. A worker host whose `ray start` gave up (its raylet did not register in
        time: "Failed to get node info ... Deadline Exceeded", seen once in a clean-clone CI on a saturated
        machine) is started again, up to `starts` times in all."""
        deadline = time.time() + timeout_s
        tries = {name: 1 for name in self.hosts}
        while True:
            alive = self.alive_nodes(check=False)
            if alive is not None and len(alive) >= count:
                return
            for h in self.hosts.values():
                if h.proc is not None and h.proc.poll() is not None:
                    if h is not self.head and tries[h.name] < starts:
                        tries[h.name] += 1
                        self._ray_start(h, head=False)
                        continue
                    raise RuntimeError(f"ray start on {h.name} exited: {self.logs[h.name].read_text()[-2000:]}")
            if time.time() > deadline:
                raise RuntimeError(f"{count} Ray nodes did not come up in {timeout_s:g}s; head log: "
                                   f"{self.logs[self.head.name].read_text()[-2000:]}")
            time.sleep(0.5)

    def run(self, host: str, cmd: list[str], timeout_s: float, cwd: str | None = None) -> subprocess.CompletedProcess:
        """A command inside a host, with the cluster's token in its environment."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[host].ns, *cmd], env=self.env(), cwd=cwd,
                              capture_output=True, text=True, timeout=timeout_s)

    def _state(self, path: str) -> list[dict]:
        """Rows of the head's state API (its dashboard, over HTTP with the cluster's token): a request from this
        process, where a driver on the head cost ~2 CPU-s a call and polled the nodes' start ~10 times."""
        request = urllib.request.Request(f"{self.jobs_address}/api/v0/{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.load(answer)["data"]["result"]["result"]

    def alive_nodes(self, check: bool = True) -> list[str] | None:
        """The addresses of the nodes the head's GCS holds alive; None (check=False) while it cannot say."""
        try:
            return sorted(n["node_ip"] for n in self._state("nodes?limit=100") if n["state"] == "ALIVE")
        except (OSError, ValueError, KeyError):  # the dashboard not up yet, or answering an error
            if check:
                raise
            return None

    def lost_hosts(self) -> list[str]:
        """The worker hosts whose node the head no longer holds alive (its raylet missed its health checks, or
        its `ray start` exited)."""
        alive = self.alive_nodes(check=False) or []
        return [h.name for h in self.hosts.values() if h is not self.head and h.address not in alive]

    def restore(self, ready_timeout_s: float = 90) -> list[str]:
        """The hosts as a test expects them: every cable a test pulled put back (a rerun of that test came before
        the head declared the host dead, and its first placement group waited on the unreachable node); every
        worker host the head declared dead killed (as at teardown) and its Ray node started afresh; no actor or
        placement group left of an earlier test's driver. Which hosts were restarted."""
        for name in sorted(self.cut):
            self.link(name, up=True)
        lost = self.lost_hosts()
        for name in lost:
            h = self.hosts[name]
            self._kill(h)
            self._ray_start(h, head=False)
        if lost:
            self._wait_for_nodes(len(self.hosts), ready_timeout_s)
        deadline = time.time() + ready_timeout_s
        while self.leftovers() != {"actors": 0, "placement_groups": 0} and time.time() < deadline:
            time.sleep(0.5)  # a killed driver's: the GCS removes them once it sees the driver gone
        return lost

    def leftovers(self) -> dict[str, int]:
        """Live actors and placement groups not removed, as Ray's state API on the head sees them."""
        actors = self._state("actors?limit=1000&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE")
        groups = [g for g in self._state("placement_groups?limit=1000") if g["state"] != "REMOVED"]
        return {"actors": len(actors), "placement_groups": len(groups)}

    # ---------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Kill every process in each namespace and each `ray start` group, then remove veths, namespaces
        and the bridge. Safe to call twice and after a partial set-up."""
        for h in self.hosts.values():
            self._kill(h)
        for h in self.hosts.values():
            ip("link", "del", h.veth, check=False)
            ip("netns", "del", h.ns, check=False)
        ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _kill(h: Host) -> None:
        """Every process of the host: those in its namespace and its `ray start` group."""
        for pid in ip("netns", "pids", h.ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if h.proc is not None:
            try:
                os.killpg(h.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            h.proc.wait(timeout=10)

    def remains(self) -> list[str]:
        """What of this harness is still there: namespaces, links, processes in its namespaces."""
        left = []
        namespaces = ip("netns", "list", check=False).stdout
        links = ip("link", "show", check=False).stdout
        for h in self.hosts.values():
            if h.ns in namespaces:
                left.append(f"namespace {h.ns}")
            if f" {h.veth}@" in links or f" {h.veth}:" in links:
                left.append(f"veth {h.veth}")
            if h.proc is not None and h.proc.poll() is None:
                left.append(f"ray start of {h.name} (pid {h.proc.pid})")
        if f" {self.bridge}:" in links:
            left.append(f"bridge {self.bridge}")
        for pid in os.listdir("/proc"):  # any process of this cluster: its Ray processes name the temp dirs
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError):
                continue
            if self.root in cmdline and pid != str(os.getpid()):
                left.append(f"process {pid}: {cmdline[:120]}")
        return left
