"""Reading raytf's series the way Prometheus does: from each Ray node's metrics endpoint
(http://<NodeManagerAddress>:<MetricsExportPort>/metrics), parsed with prometheus_client's own parser; and
with a real Prometheus (Server) scraping those endpoints, the Grafana dashboard's queries through its HTTP API."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "ray_raytf_"


def scrape(name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of series `name` (e.g. ray_raytf_steps_total) on every alive node: (labels, value)."""
    return scrape_all().get(name, [])


def scrape_all() -> dict[str, list[tuple[dict[str, str], float]]]:
    """raytf's samples on every alive node, by series name. Only raytf's lines are parsed (an endpoint also
    serves Ray's own hundreds of series)."""
    import ray

    found: dict[str, list] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue  # an agent still starting, or a node going away
        ours = "\n".join(line for line in text.splitlines() if PREFIX in line) + "\n"
        for family in text_string_to_metric_families(ours):
            for s in family.samples:
                found.setdefault(s.name, []).append((dict(s.labels), s.value))
    return found


# -- a real Prometheus (Debian's `prometheus` package, 2.42) scraping every Ray node, and the dashboard's queries
#    evaluated through its HTTP API as Grafana would send them.

SCRAPE_S = 1  # Prometheus's scrape interval here (Ray's export interval in the test cluster is 1 s too)
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval); $__interval is the
# query step (1 s here), so 4 scrapes.
RATE_INTERVAL = f"{4 * SCRAPE_S}s"
DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "raytf-dashboard.json"
INSTALL = "apt-get update && apt-get install -y prometheus"


def binary() -> str:
    """The prometheus binary; the test FAILS (not skips) without it: .ci/run installs it."""
    import pytest

    found = shutil.which("prometheus")
    if found is None:
        pytest.fail(f"the real-Prometheus test needs the `prometheus` binary (Debian's package, 2.42): {INSTALL}",
                    pytrace=False)
    return found


def node_targets() -> list[str]:
    """host:port of every alive Ray node's metrics endpoint (MetricsExportPort in ray.nodes()) that answers: a node
    an earlier test removed stays "alive" to Ray until its health checks run out (~30 s), its endpoint gone."""
    import ray

    listed = sorted({f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]})
    return [target for target in listed if _answers(target)]


def _answers(target: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5):
            return True
    except OSError:
        return False


class Server:
    """A Prometheus of the test's own: listening on 127.0.0.1 (a free port), a temp config and data folder,
    scraping `targets` every SCRAPE_S; stopped by its pid (SIGTERM, then SIGKILL) and its folder removed."""

    def __init__(self, targets: list[str], ready_timeout_s: float = 60.0):
        self.targets = targets
        self.folder = tempfile.mkdtemp(prefix="raytf-prometheus-")
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                             "evaluation_interval": "15s"},
                  "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}]}
        with open(os.path.join(self.folder, "prometheus.yml"), "w") as f:
            json.dump(config, f)  # YAML is a superset of JSON
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(os.path.join(self.folder, "prometheus.log"), "wb")
        self.process = subprocess.Popen(
            [binary(), f"--config.file={self.folder}/prometheus.yml", f"--storage.tsdb.path={self.folder}/data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_until_scraping(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_until_scraping(self, timeout_s: float) -> None:
        """Ready, and every target scraped once, up."""
        deadline, last = time.time() + timeout_s, None
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.process.returncode}): {self.log()[-2000:]}")
            try:
                targets = self.get("/api/v1/targets")["activeTargets"]
                last = {t["scrapeUrl"]: t["health"] for t in targets}
                if len(targets) == len(self.targets) and all(h == "up" for h in last.values()):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus did not scrape every Ray node within {timeout_s:g}s: {last}; "
                           f"{self.log()[-2000:]}")

    def log(self) -> str:
        with open(os.path.join(self.folder, "prometheus.log"), errors="replace") as f:
            return f.read()

    def get(self, path: str, **params) -> Any:
        """GET an HTTP API path; its `data` ("status": "success" checked)."""
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """/api/v1/query: the instant vector (or matrix, for a range selector) at `at` (now)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.get("/api/v1/query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float = SCRAPE_S) -> list[dict]:
        return self.get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step_s:g}s")["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def dashboard_queries(path: Path = DASHBOARD) -> dict[str, str]:
    """Every query of the dashboard by where it is: each panel's targets ('panel: <title>'), each Prometheus
    annotation ('annotation: <name>'), each query variable ('variable: <name>')."""
    dashboard = json.loads(path.read_text())
    queries = {}
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            queries[f"panel: {panel['title']}" + (f" ({t['refId']})" if len(panel["targets"]) > 1 else "")] = t["expr"]
    for a in dashboard["annotations"]["list"]:
        if "expr" in a:
            queries[f"annotation: {a['name']}"] = a["expr"]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            queries[f"variable: {v['name']}"] = v["query"]
    return queries


def grafana_substitute(expr: str, run: str = ".*", range_s: float = 3600.0) -> str:
    """As Grafana sends a query: its variables replaced ($run: a regex, `.*` for All)."""
    for name, value in (("${datasource}", "prometheus"), ("$__rate_interval", RATE_INTERVAL),
                        ("$__range", f"{int(range_s)}s"), ("$run", run)):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def label_values(server: Server, variable_query: str, start: float, end: float) -> list[str]:
    """A `label_values(metric, label)` variable as Grafana asks Prometheus for it over the dashboard's range."""
    match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable_query)
    assert match, variable_query
    metric, label = match.groups()
    return server.get(f"/api/v1/label/{label}/values", **{"match[]": metric, "start": f"{start:.3f}",
                                                          "end": f"{end:.3f}"})


def runs_in(result: list[dict]) -> set[str]:
    return {r["metric"].get("run", "") for r in result}


class DashboardWatch:
    """The dashboard as Grafana would show it (all runs selected), polled while a job runs (`poll` at most
    every `every_s`), then read back over the run (`after`). Records what each panel answered."""

    def __init__(self, server: Server, run: str, every_s: float = 2.0):
        self.server, self.run, self.every_s = server, run, every_s
        self.queries = {k: v for k, v in dashboard_queries().items() if k.startswith("panel: ")}
        self.started = time.time()
        self.polls: list[tuple[float, dict[str, set[str]]]] = []  # (when, panel -> runs it answered for)
        self._last = 0.0

    def poll(self) -> None:
        now = time.time()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.polls.append((now, {name: runs_in(self.server.query(grafana_substitute(expr), at=now))
                                 for name, expr in self.queries.items()}))

    def answered(self, panel: str) -> list[bool]:
        """Poll by poll, whether `panel` answered for the run, from its first answer on."""
        seen = [self.run in answers[panel] for _, answers in self.polls]
        return seen[seen.index(True):] if True in seen else []


def raw_samples(server: Server, selector: str, start: float, end: float) -> list[dict]:
    """Every stored sample of `selector` between start and end: [{"metric", "values": [[t, "v"], ...]}]."""
    return server.query(f"{selector}[{int(end - start) + 2}s]", at=end)


def longest_gap(times: list[float], start: float | None = None, end: float | None = None) -> float:
    """The longest stretch without a point, between the first and the last (or start/end, where given)."""
    points = sorted(times)
    if start is not None:
        points = [start] + points
    if end is not None:
        points = points + [end]
    return max((b - a for a, b in zip(points, points[1:])), default=float("inf"))


def check_dashboard(watch: DashboardWatch, restarts: int, deadline_s: float = 20.0) -> dict[str, Any]:
    """After a run with `restarts` restarts that `watch` polled while it ran: every query of the dashboard
    returns data for the run over its time, the job state's series has no gap longer than one scrape, the
    restarts are there from the start at 0 and marked, and the ended run's series are gone from the panels.
    Returns the figures measured."""
    server, run = watch.server, watch.run
    figures: dict[str, Any] = {"polls": len(watch.polls)}
    # While it ran: the job state answered every poll (from its first), every panel answered, and no run but
    # the live one showed (a finished run's counters stay in Ray's endpoints: the panels must leave them out).
    job_state = watch.answered("panel: Job state")
    figures["job_state_polls_answered"] = f"{sum(job_state)}/{len(job_state)}"
    assert job_state and all(job_state), f"the Job state panel missed polls while the run ran: {job_state}"
    for panel in watch.queries:
        assert any(run in answers[panel] for _, answers in watch.polls), f"{panel}: no data in any poll while it ran"
        shown = set().union(*(answers[panel] for _, answers in watch.polls))
        assert shown <= {run}, f"{panel} showed runs that were not live: {shown - {run}}"

    # Once it ended: its job state and `live` go within a few export intervals; the panels leave it.
    deadline = time.time() + deadline_s
    while server.query(f'ray_raytf_job_live{{run="{run}"}} or ray_raytf_job_state{{run="{run}"}} == 1'):
        assert time.time() < deadline, f"run {run}'s live/state series did not end within {deadline_s:g}s"
        time.sleep(0.5)
    figures["ended_after_s"] = round(time.time() - watch.polls[-1][0], 1)
    time.sleep(2 * SCRAPE_S)
    start, end = watch.started, time.time()
    for name, expr in watch.queries.items():
        assert run not in runs_in(server.query(grafana_substitute(expr))), f"{name} still shows the ended run"
    counted = runs_in(server.query("ray_raytf_steps_total"))
    assert run in counted, "the counters should still be in Ray's endpoints"
    figures["ended_runs_still_counted"] = sorted(counted)  # what the panels leave out

    # Over the run, as the dashboard reads it back: every query returns data.
    queries = dashboard_queries()
    assert run in label_values(server, queries.pop("variable: run"), start, end)
    points = {}
    for name, expr in queries.items():
        result = [r for r in server.query_range(grafana_substitute(expr, run=run), start, end) if
                  r["metric"].get("run") == run]
        points[name] = sum(len(r["values"]) for r in result)
        assert points[name], f"{name}: no data over the run ({expr})"
    figures["panels_with_data"] = f"{sum(1 for k, v in points.items() if v and k.startswith('panel'))}/" \
                                  f"{sum(1 for k in points if k.startswith('panel'))}"

    # The job state: one row, its states in order, restarting shown, no gap longer than one scrape.
    (row,) = server.query_range(grafana_substitute(queries["panel: Job state"], run=run), start, end)
    names = {1: "placing", 2: "starting", 3: "running", 4: "restarting", 5: "done", 6: "failed", 7: "interrupted"}
    values = [names[int(float(v))] for _, v in row["values"]]
    sequence = [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]
    figures["job_states"] = sequence
    assert sequence[0] in ("placing", "starting") and sequence[-1] == "done", sequence
    # A restart shorter than an export and a scrape (a dead worker's costs ~2 s now) may not show as "restarting"
    # in the state's series: the restarts counter and its annotation (below) mark every one.
    shown = [s for s in sequence if s not in ("placing", "starting")]
    seen = shown.count("restarting")
    assert shown == ["running", "restarting"] * seen + ["running", "done"] and seen <= restarts, sequence
    # Scrape by scrape: every successful scrape of the driver's node from the first that found the job state to
    # the last found it (a scrape that failed, Prometheus's own timeout on a loaded machine, is no gap of raytf's).
    raw = raw_samples(server, f'ray_raytf_job_state{{run="{run}"}}', start, end)
    scraped = sorted({float(t) for r in raw for t, v in r["values"] if float(v) == 1})
    (instance,) = {r["metric"]["instance"] for r in raw}
    up = [(float(t), float(v)) for r in raw_samples(server, f'up{{instance="{instance}"}}', start, end)
          for t, v in r["values"] if scraped[0] <= float(t) <= scraped[-1]]
    missed = [t for t, ok in up if ok == 1 and t not in set(scraped)]
    failed = sum(1 for _, ok in up if ok != 1)
    duration = server.query(f'max_over_time(scrape_duration_seconds{{instance="{instance}"}}[{int(end - start) + 2}s])',
                            at=end)
    figures.update(job_state_scrapes=len(scraped), scrapes_failed=failed, scrapes_without_job_state=len(missed),
                   longest_gap_scrapes_s=round(longest_gap(scraped), 3),
                   longest_scrape_s=round(float(duration[0]["value"][1]), 3) if duration else None,
                   longest_gap_panel_s=longest_gap([float(t) for t, _ in row["values"]]))
    assert not missed, f"scrapes of {instance} without the job state: {missed}; {figures}"
    if not failed:  # as the dashboard reads it, at a step of one scrape
        assert figures["longest_gap_panel_s"] <= SCRAPE_S, figures

    # Restarts: 0 from the job state's first scrape on, `restarts` at the end; the annotation marks them.
    counted = sorted((float(t), float(v)) for r in raw_samples(server, f'ray_raytf_restarts_total{{run="{run}"}}',
                                                                start, end) for t, v in r["values"])
    assert counted and counted[0][1] == 0 and counted[-1][1] == restarts, counted
    assert counted[0][0] <= scraped[0] + 2 * SCRAPE_S, (counted[0], scraped[0])
    marked = [float(t) for r in server.query_range(grafana_substitute(queries["annotation: Restarts"], run=run),
                                                   start, end) for t, _ in r["values"]]
    restarting = [float(t) for t, v in row["values"] if names[int(float(v))] == "restarting"]
    # Every restart is marked; the state panel shows "restarting" only for one that outlasted a scrape (above)
    assert marked, (marked, restarting, sequence)
    if restarting:
        figures["restart_marked_s_after_restarting_began"] = round(min(marked) - min(restarting), 1)
    figures["restarting_shown_s"] = len(restarting) * SCRAPE_S
    return figures
