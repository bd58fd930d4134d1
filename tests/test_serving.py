"""From training to serving and insight: a SavedModel that serves without raytf through TF Serving's own
loader (the TF1 session loader: functional, subclassed, train_fn, tf.keras and parameter-server models), the
guide's saved_model_cli commands as written, profiler traces of the asked steps and ranks, per-rank time with
the slow rank named, and actors named after their job, role and rank."""
import json
import re
import subprocess
import textwrap
import time
from pathlib import Path

import keras
import numpy as np
import pyarrow.parquet as pq
import pytest

import raytf
from raytf.driver import stragglers
from raytf.errors import SpecError
from raytf.job import parse
from tests.conftest import DIGITS, REPO, assert_nothing_left, base_spec, write_job
from tests.faults import rank_one_data
from tests.serving import saved_model_cli, serve_in_a_fresh_process, session_serve

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


def test_a_workers_summary_line_counts_every_step_it_ran_and_the_timed_ones_apart():
    from raytf.driver.report import worker_lines

    task = {"rank": 0, "role": "chief", "node_ip": "10.0.0.1", "steps": 22, "timed_steps": 21, "input_wait_s": 0.1,
            "step_s": 0.2, "examples_per_s": 1000.0}
    assert worker_lines([task]) == \
        "rank 0 (chief on 10.0.0.1): 22 steps, 21 timed: input wait 0.10 s, step 0.20 s, 1,000 ex/s"


# Keras 3 and tf.keras models for the in-process export checks: BatchNormalization whose moving statistics
# are not the initial ones (a variable the session loader must restore, not initialize), and Dropout (off).
KERAS3_MODEL = textwrap.dedent('''
    import keras

    def build_model():
        return keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.BatchNormalization(), keras.layers.Dropout(0.3), keras.layers.Dense(10)])
''')
TF_KERAS_MODEL = KERAS3_MODEL.replace("import keras", "import tf_keras as keras")


def _payload(job_dir, monkeypatch, model: str | None, train_fn: str | None = None, **train):
    """A chief's payload for digits with output.export [keras, saved_model]: the spec's model function
    (`model`), or none (a train_fn that builds its own model and saves it with ctx.save_model)."""
    from raytf import data_scan
    from raytf.protocol import WorkerPayload

    (job_dir / "k3.py").write_text(KERAS3_MODEL)
    (job_dir / "tfk.py").write_text(TF_KERAS_MODEL)
    monkeypatch.syspath_prepend(str(job_dir))
    spec = base_spec(model=model, train_fn=train_fn, train=train,
                     output={"export": ["keras", "saved_model"]})
    spec = parse({k: v for k, v in spec.items() if v is not None})
    train_file = str(job_dir / "data" / "digits-train.parquet")
    return WorkerPayload(spec, train_data=data_scan.read_info(train_file, ["pixels"], "label"), train_root=train_file)


def _trained_as_if(model, seed: int = 0):
    """Weights no initializer gives: random kernels and biases, BatchNormalization statistics away from 0/1."""
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0.0, 0.3, w.shape).astype(np.float32) if "variance" not in getattr(v, "name", "")
                       else rng.uniform(0.5, 2.0, w.shape).astype(np.float32)
                       for v, w in zip(model.weights, model.get_weights())])
    return model


def _test_rows():
    rows = pq.read_table(DIGITS / "digits-test.parquet").to_pydict()
    return np.asarray(rows["pixels"], np.float32), np.asarray(rows["label"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["keras3-model-fn", "keras3-train_fn", "tf_keras-model-fn", "tf_keras-train_fn",
                                  "parameter-servers"])
def test_an_exported_saved_model_serves_through_tf_servings_loader_as_model_keras_predicts(kind, job_dir, tmp_path,
                                                                                           monkeypatch):
    """export.write as raytf's loop and ctx.save_model call it (a copy built by the spec's model function, or
    cloned from a train_fn's model), and as the parameter-server chief does (plain=True: its own plain copy).
    TF Serving's loader (a TF1 Session) predicts the test rows as model.keras does. The SavedModel raytf wrote
    before (the model as an attribute of a tf.Module) failed there: Could not find variable ...."""
    from raytf.actor import export

    legacy = kind.startswith("tf_keras")
    if legacy:
        import tf_keras as keras_
    else:
        keras_ = keras
    module = "tfk" if legacy else "k3"
    train_fn = f"{module}:train" if "train_fn" in kind or legacy else None  # (never imported here)
    payload = _payload(job_dir, monkeypatch, None if kind.endswith("train_fn") else f"{module}:build_model",
                       train_fn, **({"keras": "legacy"} if legacy else {}))
    build = __import__(module).build_model
    model = _trained_as_if(build())
    staging = tmp_path / "staging"
    staging.mkdir()
    exports = export.write(model, payload, str(staging), plain=kind == "parameter-servers")
    assert exports == {"keras": "model.keras", "saved_model": "saved_model"}

    pixels, _ = _test_rows()
    outputs, info = session_serve(str(staging / "saved_model"), {"pixels": pixels})
    assert info == {"inputs": ["pixels"], "outputs": ["output"]}
    assert outputs["output"].dtype == np.float32 and outputs["output"].shape == (len(pixels), 10)
    expected = keras_.models.load_model(str(staging / "model.keras")).predict(pixels, verbose=0)
    np.testing.assert_allclose(outputs["output"], expected, rtol=1e-5, atol=1e-5)  # measured: max |diff| 0


@pytest.mark.timeout(120)
def test_the_documented_saved_model_cli_commands_run_as_written(job_dir, tmp_path, monkeypatch):
    """docs/guides/serving-and-insight.md's saved_model_cli commands (and the line that makes their input),
    run by bash as written, from a folder laid out as they assume (runs/digits/saved_model from export.write,
    jobs/data/): `run` loads it as TF Serving does and prints what model.keras predicts for the test row."""
    from raytf.actor import export

    guide = (REPO / "docs" / "guides" / "serving-and-insight.md").read_text()
    block = guide.split("## Serving", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = re.findall(r"^(?:python|saved_model_cli) .*?(?<!\\)$", block, flags=re.M | re.S)
    assert [c.split()[:2] for c in commands] == [["saved_model_cli", "show"], ["python", "-c"],
                                                  ["saved_model_cli", "run"]], commands
    assert "np.zeros" not in block  # --input_exprs takes Python literals only (TF 2.21)

    payload = _payload(job_dir, monkeypatch, "k3:build_model")
    model = _trained_as_if(__import__("k3").build_model())
    staging = tmp_path / "runs" / "digits"
    staging.mkdir(parents=True)
    export.write(model, payload, str(staging))
    (tmp_path / "jobs").symlink_to(REPO / "jobs")
    said = []
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        said.append(proc.stdout)
    assert "inputs['pixels'] tensor_info:" in said[0] and "outputs['output'] tensor_info:" in said[0]
    printed = said[2].split("Result for output key output:", 1)[1]
    served = np.asarray([float(x) for x in re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?", printed)], np.float32)
    pixels, _ = _test_rows()
    np.testing.assert_allclose(served, model.predict(pixels[:1], verbose=0)[0], rtol=1e-5, atol=1e-4)


def _spec_error(**sections):
    with pytest.raises(SpecError) as info:
        parse({k: v for k, v in base_spec(**sections).items() if v is not None})
    return info.value


CUSTOM_LAYERS = """
import keras


@keras.saving.register_keras_serializable(package="shop")
class Doubled(keras.layers.Layer):
    def call(self, x):
        return x * 2


class Unregistered(keras.Model):  # not registered: a loader cannot find the class the file names
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)
"""


@pytest.mark.timeout(120)
def test_the_chief_says_what_loading_model_keras_takes_when_a_plain_load_is_not_enough(tmp_path, monkeypatch):
    """Loaded as a user would before it is announced: a plain model needs nothing said; one with a registered
    layer names the module to import; a Python lambda needs safe_mode=False; a subclassed model whose class is
    not registered does not load as written, and the line says why and the fix."""
    import sys

    from raytf.actor import export

    (tmp_path / "shoplayers.py").write_text(CUSTOM_LAYERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import shoplayers

    def saved(model, name):
        folder = tmp_path / name
        folder.mkdir()
        model(np.zeros((1, 4), "float32"))
        model.save(folder / export.KERAS_FILE)
        return str(folder)

    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert export.load_note(saved(plain, "plain")) is None
    custom = keras.Sequential([keras.Input((4,)), shoplayers.Doubled(), keras.layers.Dense(2)])
    assert export.load_note(saved(custom, "custom")) == ("model.keras loads with load_model(path) once "
                                                         "`import shoplayers` has run (it registers the model's "
                                                         "own classes)")
    lam = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda x: x + 1), keras.layers.Dense(2)])
    assert export.load_note(saved(lam, "lambda")).startswith("model.keras loads only with load_model(path, "
                                                             "safe_mode=False)")
    said = export.load_note(saved(shoplayers.Unregistered(), "subclassed"))
    assert said.startswith("model.keras does not load as written (") and "get_config()" in said, said
    sys.modules.pop("shoplayers", None)


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
    # Served as TF Serving loads it (the session loader), the test rows (the run's validation set, every row
    # once) are classified with the accuracy the run reported for them.
    accuracy = float((np.argmax(served, 1) == np.asarray(rows["label"])).mean())  # measured: 0.827778 = reported
    assert accuracy == pytest.approx(result.history[-1]["val_accuracy"], abs=1e-6) and accuracy > 0.5
    assert {"saved_model.pb", "variables", "fingerprint.pb"} <= {p.name for p in Path(saved).iterdir()}
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
def test_a_rank_with_slow_input_is_named_with_its_cost_and_actors_and_tasks_show_as_their_job_role_and_index(
        cluster, job_dir):
    """Rank 1's input is slow: its wait is named with its cost, rank 0's is not. And while the job trains,
    each actor is named raytf:<job>:<role>-<index> (`ray list actors`, the dashboard), on the node of the
    rank it then plays, and its training task carries the same name (`ray list tasks`)."""
    import ray
    from ray.util.state import list_actors, list_tasks

    from raytf.driver.controller import run
    from raytf.driver.ray_group import RayWorkerGroup
    from raytf.job import load

    tasks, actors = [], {}

    address = ray.get_runtime_context().gcs_address  # this process's cluster, not the newest on the machine

    class Looking(RayWorkerGroup):
        def train(self, payload):  # every task is set up (and named) by now
            refs = super().train(payload)
            actors.update({a.name: a.node_id for a in list_actors(address=address, filters=[("state", "=", "ALIVE")],
                                                                  limit=10000)
                           if (a.name or "").startswith("raytf:named:")})
            deadline = time.time() + 20
            while time.time() < deadline and len(tasks) < 2:
                tasks[:] = sorted({t.name for t in list_tasks(address=address, filters=[("state", "=", "RUNNING")],
                                                              limit=10000)
                                   if t.name.startswith("raytf:named:")})
                time.sleep(0.5)
            return refs

    (job_dir / "slow.py").write_text(rank_one_data(delay_s=0.006))  # ~50 ms a batch, on rank 1 only
    spec = base_spec(name="named", dataset_fn="slow:dataset_fn",
                     train={"epochs": 1, "global_batch_size": 16, "steps_per_epoch": 30},
                     output={"tensorboard": False, "timing": True})
    spec.pop("data")
    result = run(load(write_job(job_dir, spec)), group_cls=Looking)
    workers = {t["rank"]: t for t in result.tasks}
    assert workers[1]["input_wait_s"] > 1.0 > workers[0]["input_wait_s"], workers
    assert workers[0]["step_s"] > workers[1]["step_s"]  # rank 0 waits for rank 1 in the all-reduce
    assert len(result.stragglers) == 1, result.stragglers
    slow = result.stragglers[0]
    assert slow["rank"] == 1 and slow["what"] == "input_wait_s" and slow["node"] == workers[1]["node_ip"]
    assert 0.2 < slow["cost"] <= 1.0, slow  # ~0.3-0.4 idle; 0.287 seen in a clean-clone CI under load
    saved = json.loads((job_dir / "runs" / "named" / "result.json").read_text())
    assert saved["stragglers"] == result.stragglers
    assert tasks == ["raytf:named:worker-0", "raytf:named:worker-1"]
    assert actors == {f"raytf:named:worker-{t['rank']}": t["node_id"] for t in result.tasks}, (actors, result.tasks)
    assert_nothing_left()
