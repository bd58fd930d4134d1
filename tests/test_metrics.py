"""raytf's Prometheus series without Ray: what a task's channel records through ray.util.metrics (replaced
here by a recorder at that seam). The series in a real node's endpoint: test_cluster.py's two-node job."""
import time

import pytest

from raytf.actor.channel import TaskChannel

pytestmark = pytest.mark.timeout(30)


class Recorded:
    """Stands in for ray.util.metrics.Counter/Gauge: keeps every value per tag set."""

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.defaults, self.values = name, tag_keys, {}, {}
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


registry: dict[str, Recorded] = {}


@pytest.fixture
def series(monkeypatch):
    from ray.util import metrics

    registry.clear()
    monkeypatch.setattr(metrics, "Counter", Recorded)
    monkeypatch.setattr(metrics, "Gauge", Recorded)
    from raytf.metrics import TaskSeries

    return TaskSeries("digits", "worker", 1, "node-a")


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
    assert phases == {"restoring": 0, "train": 0, "validating": 1}
    assert "raytf_loss" not in {n for n, r in registry.items() if r.values}  # a NaN loss is not a value
    registry["raytf_global_step"].values.clear()
    registry["raytf_task_phase"].values.clear()
    channel.progress()  # the driver's poll: Ray drops a gauge that is not set again
    assert only("raytf_global_step") == 11 and only("raytf_task_phase") == 1


def test_the_jobs_state_counts_a_restart_that_goes_ahead_and_not_the_failure_that_ends_it(monkeypatch):
    from ray.util import metrics

    registry.clear()
    monkeypatch.setattr(metrics, "Counter", Recorded)
    monkeypatch.setattr(metrics, "Gauge", Recorded)
    from raytf.metrics import JobSeries

    job = JobSeries("digits")
    try:  # as the controller steps: one failure restarted, then one that the restart policy gives up on
        for state in ("placing", "starting", "running", "running", "restarting", "placing", "starting", "running",
                      "restarting", "failed"):
            job.state(state)
    finally:
        job.close()
    assert only("raytf_restarts") == 1
    states = {dict(k)["state"]: v for k, v in registry["raytf_job_state"].values.items()}
    assert states == {"placing": 0, "starting": 0, "running": 0, "restarting": 0, "failed": 1}


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
