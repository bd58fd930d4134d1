"""raytf's Prometheus series without Ray: what a task's channel records through ray.util.metrics (replaced
here by a recorder at that seam), and the Grafana dashboard against the schemas Grafana's kinds publish. The
series in real nodes' endpoints, and scraped by a real Prometheus with every dashboard query evaluated:
test_fault_tolerance.py's killed worker (tests/prometheus.py)."""
import time

import pytest

from raytf.actor.channel import TaskChannel

pytestmark = pytest.mark.timeout(30)


class Recorded:
    """Stands in for ray.util.metrics.Counter/Gauge: keeps every value per tag set."""

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.defaults, self.values, self.sets = name, tag_keys, {}, {}, 0
        registry[name] = self

    def set_default_tags(self, tags):
        self.defaults = dict(tags)

    def _key(self, tags):
        merged = {**self.defaults, **(tags or {})}
        assert set(merged) == set(self.tag_keys), (self.name, merged)  # Ray refuses a missing tag
        assert all(isinstance(v, str) for v in merged.values())  # and a tag that is not a str
        return tuple(sorted(merged.items()))

    def inc(self, value=1.0, tags=None):
        assert value > 0  # Ray's Counter refuses 0 and less
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0) + value

    def set(self, value, tags=None):
        self.values[self._key(tags)] = value
        self.sets += 1

    def _record(self, value, tags=None):  # what Counter.inc calls, and JobSeries for its 0
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0) + value


registry: dict[str, Recorded] = {}


@pytest.fixture
def recorded(monkeypatch):
    from ray.util import metrics

    registry.clear()
    monkeypatch.setattr(metrics, "Counter", Recorded)
    monkeypatch.setattr(metrics, "Gauge", Recorded)
    return registry


@pytest.fixture
def series(recorded):
    from raytf.metrics import TaskSeries

    made = TaskSeries("digits", "worker", 1, "node-a")
    yield made
    made.close()


def only(name):
    values = registry[name].values
    assert len(values) == 1, values
    return next(iter(values.values()))


def test_every_step_is_counted_once_though_the_series_are_updated_twice_a_second(series):
    channel = TaskChannel(1, full_update_s=0.05, series=series)
    channel.start_at(100)  # as the loop does: it resumed at step 100
    totals = {"input_wait_s": 0.0, "step_s": 0.0}
    channel.timing_source = lambda: dict(totals)
    for step in range(1, 41):
        totals = {"input_wait_s": 0.01 * step, "step_s": 0.02 * step}
        channel.train_step(epoch=1, step=step, steps=40, global_step=100 + step, loss=0.5, examples=64)
        time.sleep(0.004)
    assert only("raytf_steps") == 40 and only("raytf_examples") == 40 * 64  # this process's steps, not the run's
    assert only("raytf_global_step") == 140 and only("raytf_epoch") == 1 and only("raytf_loss") == 0.5
    assert only("raytf_input_wait_seconds") == pytest.approx(0.4) and only("raytf_step_seconds") == pytest.approx(0.8)
    tags = dict(next(iter(registry["raytf_steps"].values)))
    assert tags == {"run": "digits", "role": "worker", "rank": "1", "node": "node-a"}


def test_the_phase_is_one_for_the_current_and_zero_for_the_one_left_and_a_poll_sets_gauges_again(series):
    channel = TaskChannel(1, series=series)
    channel.phase("restoring")
    channel.train_step(epoch=2, step=1, steps=10, global_step=11, loss=float("nan"), examples=32)
    channel.phase("validating")
    phases = {dict(k)["phase"]: v for k, v in registry["raytf_task_phase"].values.items()}
    assert phases == {"starting": 0, "restoring": 0, "train": 0, "validating": 1}  # starting: from its making
    assert "raytf_loss" not in {n for n, r in registry.items() if r.values}  # a NaN loss is not a value
    registry["raytf_global_step"].values.clear()
    registry["raytf_task_phase"].values.clear()
    channel.progress()  # the driver's poll: Ray drops a gauge that is not set again
    assert only("raytf_global_step") == 11 and only("raytf_task_phase") == 1


def test_the_jobs_state_counts_a_restart_that_goes_ahead_and_not_the_failure_that_ends_it(recorded):
    from raytf.metrics import JobSeries

    job = JobSeries("digits")
    assert only("raytf_restarts") == 0 and only("raytf_job_live") == 1  # there from the start
    assert only("raytf_job_state") == 1 and dict(next(iter(registry["raytf_job_state"].values)))["state"] == "placing"
    shown = []
    try:  # as the controller steps: one failure restarted, then one that the restart policy gives up on
        for state in ("starting", "running", "running", "restarting", "placing", "starting", "running",
                      "restarting", "failed"):
            job.state(state)
            shown.append(next(dict(k)["state"] for k, v in registry["raytf_job_state"].values.items() if v == 1))
    finally:
        job.close()
    assert only("raytf_restarts") == 1
    states = {dict(k)["state"]: v for k, v in registry["raytf_job_state"].values.items()}
    assert states == {"placing": 0, "starting": 0, "running": 0, "restarting": 0, "failed": 1}
    # restarting lasts from the failure until the new attempt runs (a restart's decision alone takes
    # milliseconds: no export would carry it)
    assert shown == ["starting", "running", "running", "restarting", "restarting", "restarting", "running",
                     "restarting", "failed"]
    assert only("raytf_job_live") == 0


def test_every_gauge_is_set_again_within_each_export_interval_until_closed(recorded):
    """Ray drops a gauge that no export of its process carried for two of the node's export intervals: the
    keep-alive sets each one several times per interval, whatever the task or the driver is doing."""
    from raytf.metrics import JobSeries, TaskSeries

    task, job = TaskSeries("digits", "chief", 0, "node-a", interval_s=0.2), JobSeries("digits", interval_s=0.2)
    task.stepped(5, 320, 5, 1, 0.5)
    task.checkpointed(0.3)
    gauges = ("raytf_global_step", "raytf_epoch", "raytf_loss", "raytf_checkpoint_seconds", "raytf_task_phase",
              "raytf_job_state", "raytf_job_live")
    before = {name: registry[name].sets for name in gauges}
    time.sleep(0.45)  # no call from the task's loop or the driver's controller meanwhile
    again = {name: registry[name].sets - before[name] for name in gauges}
    assert all(n >= 3 for n in again.values()), again  # every 0.05 s: ~9 each
    task.close()
    job.close()
    time.sleep(0.1)
    closed = {name: registry[name].sets for name in gauges}
    time.sleep(0.3)
    assert {name: registry[name].sets for name in gauges} == closed  # then nothing: Ray drops them
    task.refresh()  # a driver's poll after the task's end sets nothing either
    assert {name: registry[name].sets for name in gauges} == closed


def test_a_driver_joining_a_cluster_exports_every_second_unless_told_otherwise():
    from raytf.metrics import driver_exports_every_second

    environ = {}
    driver_exports_every_second(environ)
    assert environ == {"RAY_metrics_report_interval_ms": "1000"}
    environ = {"RAY_metrics_report_interval_ms": "5000"}
    driver_exports_every_second(environ)
    assert environ == {"RAY_metrics_report_interval_ms": "5000"}


def test_a_train_fns_steps_since_the_last_update_are_counted_at_its_epochs_end(series):
    channel = TaskChannel(0, full_update_s=60, series=series)  # one full update (the first step), then none
    for step in range(1, 8):
        channel.train_step(epoch=1, step=step, steps=None, global_step=step, loss=0.3, examples=16)
    channel.epoch_end({"epoch": 1, "loss": 0.3})
    assert only("raytf_steps") == 7 and only("raytf_examples") == 7 * 16 and only("raytf_global_step") == 7


def test_steps_are_counted_from_the_global_step_a_restore_and_a_once_an_epoch_ctx_step_included(series):
    import numpy as np

    channel = TaskChannel(0, full_update_s=0, series=series)
    channel.start_at(100)  # a checkpoint restored at step 100: those steps are not this process's
    for epoch, step in ((1, np.int64(150)), (2, np.int64(200))):  # ctx.step(optimizer.iterations.numpy())
        channel.train_step(epoch=epoch, step=50, steps=50, global_step=step, loss=np.float32(0.25), examples=32)
    assert only("raytf_steps") == 100 and only("raytf_examples") == 100 * 32
    assert only("raytf_global_step") == 200 and type(only("raytf_global_step")) is int


def test_a_failing_metrics_call_is_said_once_and_training_goes_on(series, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("value must be int or float")

    monkeypatch.setattr(series, "stepped", broken)
    channel = TaskChannel(3, full_update_s=0, series=series)
    for step in (1, 2, 3):
        channel.train_step(epoch=1, step=step, steps=3, global_step=step, loss=0.5, examples=8)
    channel.phase("validating")
    assert channel.progress().global_step == 3  # the channel itself goes on
    assert capsys.readouterr().out.count("output.metrics stopped") == 1


def test_the_grafana_dashboard_queries_only_series_raytf_records():
    import json
    import re

    from tests.conftest import REPO

    source = (REPO / "raytf" / "metrics.py").read_text()
    counters = set(re.findall(r'Counter\("(\w+)"', source))
    gauges = set(re.findall(r'Gauge\("(\w+)"', source))
    exported = {f"ray_{c}_total" for c in counters} | {f"ray_{g}" for g in gauges}  # as Ray names them
    dashboard = json.loads((REPO / "docs" / "grafana" / "raytf-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"ray_raytf_\w+", target["expr"])}
    assert queried and queried <= exported, queried - exported
    assert {"ray_raytf_steps_total", "ray_raytf_input_wait_seconds_total", "ray_raytf_job_state"} <= queried


def test_the_dashboard_reads_rates_over_grafanas_rate_interval_and_shows_live_runs_only():
    """[1m] is empty at Prometheus's default 1-min scrape; $__rate_interval is at least 4 scrapes. Finished runs'
    counters stay in Ray's endpoints: every panel but the job state keeps only the runs live at each instant."""
    import re

    from tests.prometheus import dashboard_queries

    queries = dashboard_queries()
    windows = {w for expr in queries.values() for w in re.findall(r"\[([^\]]+)\]", expr)}
    assert windows == {"$__rate_interval"}, windows
    for name, expr in queries.items():
        if name.startswith("panel: ") and name != "panel: Job state":
            assert expr.endswith(' and on (run) (ray_raytf_job_live{run=~"$run"} == 1)'), name
    assert queries["variable: run"] == "label_values(ray_raytf_job_live, run)"


def test_the_dashboard_is_valid_against_grafanas_published_schemas():
    """The dashboard kind, each panel's options and field config against its panel kind, each target against
    the Prometheus query kind: grafana-foundation-sdk's JSON schemas for Grafana 11.6 (tests/data/README.md)."""
    import json

    from jsonschema import Draft7Validator

    from tests.conftest import REPO

    schemas = REPO / "tests" / "data" / "grafana-11.6"

    def validator(kind, definition=None):
        schema = json.loads((schemas / f"{kind}.jsonschema.json").read_text())
        if definition is not None:
            assert definition in schema["definitions"], (kind, definition)
            schema = {**schema, "$ref": f"#/definitions/{definition}"}
        return Draft7Validator(schema)

    dashboard = json.loads((REPO / "docs" / "grafana" / "raytf-dashboard.json").read_text())
    errors = [f"dashboard {list(e.absolute_path)}: {e.message}" for e in validator("dashboard").iter_errors(dashboard)]
    query = validator("prometheus")
    for panel in dashboard["panels"]:
        kind = panel["type"].replace("-", "")  # state-timeline: statetimeline.jsonschema.json
        where = f"panel {panel['title']!r}"
        errors += [f"{where} options {list(e.absolute_path)}: {e.message}"
                   for e in validator(kind, "Options").iter_errors(panel["options"])]
        if "FieldConfig" in json.loads((schemas / f"{kind}.jsonschema.json").read_text())["definitions"]:
            custom = panel["fieldConfig"]["defaults"].get("custom", {})
            errors += [f"{where} fieldConfig.defaults.custom {list(e.absolute_path)}: {e.message}"
                       for e in validator(kind, "FieldConfig").iter_errors(custom)]
        errors += [f"{where} target {list(e.absolute_path)}: {e.message}"
                   for target in panel["targets"] for e in query.iter_errors(target)]
    assert not errors, "\n".join(errors)
    names = [a["name"] for a in dashboard["annotations"]["list"]]
    assert "Restarts" in names  # marks each restart on every panel
