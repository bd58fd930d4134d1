"""From training to serving and insight: a SavedModel that serves without raytf (functional, subclassed,
parameter-server models), profiler traces of the asked steps and ranks, per-rank time with the slow rank
named, and actors named after their job, role and rank."""
import json
import textwrap
import time

import keras
import numpy as np
import pyarrow.parquet as pq
import pytest

import raytf
from raytf.driver import stragglers
from raytf.errors import SpecError
from raytf.job import parse
from tests.conftest import DIGITS, assert_nothing_left, base_spec, write_job
from tests.faults import rank_one_data
from tests.serving import saved_model_cli, serve_in_a_fresh_process

SUBCLASSED_MODEL = textwrap.dedent('''
    import keras

    @keras.saving.register_keras_serializable(package="tests")
    class Digits(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(32)
            self.norm = keras.layers.BatchNormalization()
            self.drop = keras.layers.Dropout(0.2)
            self.out = keras.layers.Dense(10)

        def call(self, x, training=False):
            h = keras.ops.relu(self.norm(self.hidden(x), training=training))
            return self.out(self.drop(h, training=training))

    def build_model():
        return Digits()
''')

@pytest.mark.timeout(30)
def test_export_and_profile_keys_are_checked():
    assert "output.export.0: 'onnx' is not one of" in str(_spec_error(output={"export": ["onnx"]}))
    assert "needs data (Parquet), not dataset_fn" in str(_spec_error(
        data=None, dataset_fn="tmodel:build_model", train={"steps_per_epoch": 5}, output={"export": ["saved_model"]}))
    assert "1 <= first <= last" in str(_spec_error(output={"profile": {"steps": [5, 2]}}))
    assert "the job has ranks 0..1" in str(_spec_error(output={"profile": {"steps": [2, 4], "ranks": [0, 2]}}))
    assert parse(base_spec(output={"profile": {"steps": [2, 4]}})).output.profile.ranks == [0]


@pytest.mark.timeout(30)
def test_stragglers_are_the_workers_that_stand_out_with_what_they_cost():
    def worker(rank, wait, step, steps=100):
        return {"rank": rank, "node_ip": f"10.0.0.{rank}", "input_wait_s": wait, "step_s": step, "timed_steps": steps}

    # In step (mirrored): rank 2 waits 3 s more for its input, and the others wait for it in the all-reduce.
    found = stragglers.find([worker(0, 0.1, 4.0), worker(1, 0.1, 4.0), worker(2, 3.1, 1.0)], 5.0, synchronous=True)
    assert found == [{"rank": 2, "node": "10.0.0.2", "what": "input_wait_s", "seconds": 3.1, "typical_s": 0.1,
                      "cost": 0.6}]
    assert "rank 2 on 10.0.0.2 is slow: input wait 3.10 s" in stragglers.describe(found[0], True)
    assert stragglers.find([worker(0, 0.1, 1.0), worker(1, 0.12, 1.1)], 2.0, synchronous=True) == []
    assert stragglers.find([worker(0, 0.1, 1.0)], 2.0, synchronous=True) == []
    # On their own (parameter servers): worker 1's steps take four times as long; it delivers a quarter.
    found = stragglers.find([worker(0, 0.1, 1.0), worker(1, 0.1, 2.1, steps=50), worker(2, 0.1, 1.0)], 10.0,
                            synchronous=False)
    assert [(f["rank"], f["what"], f["cost"]) for f in found] == [(1, "step_s", 0.25)]


def _spec_error(**sections):
    with pytest.raises(SpecError) as info:
        parse({k: v for k, v in base_spec(**sections).items() if v is not None})
    return info.value


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_subclassed_model_exports_a_saved_model_that_serves_without_raytf(cluster, job_dir, tmp_path,
                                                                             monkeypatch):
    (job_dir / "subclassed.py").write_text(SUBCLASSED_MODEL)
    result = raytf.fit(write_job(job_dir, base_spec(
        model="subclassed:build_model", train={"epochs": 1},
        output={"export": ["keras", "saved_model"], "profile": {"steps": [3, 5], "ranks": [0]}, "timing": True})))
    saved = result.exports["saved_model"]
    assert result.exports["keras"] == result.model_path and saved == str(job_dir / "runs" / "t" / "saved_model")
    assert json.loads((job_dir / "runs" / "t" / "result.json").read_text())["exports"] == result.exports
    rows = pq.read_table(DIGITS / "digits-test.parquet").to_pydict()
    pixels = np.asarray(rows["pixels"], np.float32)
    served, info = serve_in_a_fresh_process(saved, {"pixels": pixels}, tmp_path)
    assert info == {"raytf_imported": False, "inputs": ["pixels"], "outputs": ["output"]}
    monkeypatch.syspath_prepend(str(job_dir))
    import subclassed  # noqa: F401 (registers the class for load_model)

    expected = keras.models.load_model(result.model_path).predict(pixels, verbose=0)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
    assert (np.argmax(served, 1) == np.asarray(rows["label"])).mean() > 0.5  # it learned something
    shown = saved_model_cli(saved)
    assert "signature_def['serving_default']" in shown and "inputs['pixels']" in shown
    assert "shape: (-1, 64)" in shown and "outputs['output']" in shown

    # The profile: rank 0 only, where TensorBoard's profile plugin looks, and a trace that parses. Rank 0
    # because TF 2.21's profiler can crash another MultiWorkerMirrored rank when the trace stops (docs/known-issues.md, profiler).
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    profiles = job_dir / "runs" / "t" / "tensorboard" / "profile"
    assert sorted(p.name for p in profiles.iterdir()) == ["rank-0"]
    traces = list((profiles / "rank-0" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1, traces
    space = xplane_pb2.XSpace.FromString(traces[0].read_bytes())
    assert space.planes and sum(len(line.events) for plane in space.planes for line in plane.lines) > 0

    # Where the time went, per worker; nobody slow in a run with nobody slow.
    workers = [t for t in result.tasks if "timed_steps" in t]
    assert [t["rank"] for t in workers] == [0, 1]
    assert all(t["timed_steps"] == 1437 // 64 - 1 for t in workers)  # all but each worker's first step
    assert all(t["step_s"] > 0 and t["input_wait_s"] >= 0 and t["examples_per_s"] > 0 for t in workers)
    assert result.stragglers == []
    timing_runs = sorted(p.name for p in (job_dir / "runs" / "t" / "tensorboard" / "timing").iterdir())
    assert timing_runs == ["worker-0", "worker-1"]
    assert_nothing_left()





@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_rank_with_slow_input_is_named_with_its_cost_and_the_others_are_not(cluster, job_dir):
    (job_dir / "slow.py").write_text(rank_one_data(delay_s=0.006))  # ~50 ms a batch, on rank 1 only
    spec = base_spec(dataset_fn="slow:dataset_fn", train={"epochs": 1, "global_batch_size": 16, "steps_per_epoch": 30},
                     output={"tensorboard": False, "timing": True})
    spec.pop("data")
    result = raytf.fit(write_job(job_dir, spec))
    workers = {t["rank"]: t for t in result.tasks}
    assert workers[1]["input_wait_s"] > 1.0 > workers[0]["input_wait_s"], workers
    assert workers[0]["step_s"] > workers[1]["step_s"]  # rank 0 waits for rank 1 in the all-reduce
    assert len(result.stragglers) == 1, result.stragglers
    slow = result.stragglers[0]
    assert slow["rank"] == 1 and slow["what"] == "input_wait_s" and slow["node"] == workers[1]["node_ip"]
    assert 0.3 < slow["cost"] <= 1.0, slow
    saved = json.loads((job_dir / "runs" / "t" / "result.json").read_text())
    assert saved["stragglers"] == result.stragglers
    assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_actors_and_tasks_show_as_their_job_role_and_index(cluster, job_dir):
    """Each actor is created named raytf:<job>:<role>-<index> (`ray list actors`, the dashboard), on the node of
    the rank it then plays, and its training task carries the same name (`ray list tasks`)."""
    from ray.util.state import list_actors, list_tasks

    from raytf.driver.controller import run
    from raytf.driver.ray_group import RayWorkerGroup
    from raytf.job import load

    tasks, actors = [], {}

    class Looking(RayWorkerGroup):
        def train(self, payload):  # every task is set up (and named) by now
            refs = super().train(payload)
            actors.update({a.name: a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10000)
                           if (a.name or "").startswith("raytf:named:")})
            deadline = time.time() + 20
            while time.time() < deadline and len(tasks) < 2:
                tasks[:] = sorted({t.name for t in list_tasks(filters=[("state", "=", "RUNNING")], limit=10000)
                                   if t.name.startswith("raytf:named:")})
                time.sleep(0.5)
            return refs

    result = run(load(write_job(job_dir, base_spec(name="named", train={"epochs": 1}, output={"tensorboard": False}))),
                 group_cls=Looking)
    assert tasks == ["raytf:named:worker-0", "raytf:named:worker-1"]
    assert actors == {f"raytf:named:worker-{t['rank']}": t["node_id"] for t in result.tasks}, (actors, result.tasks)
    assert_nothing_left()
