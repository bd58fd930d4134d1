"""raytf as users run it: the real console script, started from the job folder, its parent and an
unrelated folder, with relative, absolute and symlinked job files, and models with state
(BatchNormalization, Dropout, Embedding, LayerNormalization). Each run checks what it leaves behind:
nothing new in the job folder outside output.dir, and only raytf's own lines on the terminal."""
import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import DIGITS, REPO, base_spec, task_files_in_temp_dir, write_job

pytestmark = pytest.mark.timeout(300)

RAYTF = str(Path(sys.executable).parent / "raytf")  # the console script pip installed

STATEFUL_MODEL = textwrap.dedent('''
    """Layers with state, as users write them: BatchNormalization, Dropout, Embedding, LayerNormalization."""
    import keras


    def build_model(width=48):
        pixels = keras.Input(shape=(64,), name="pixels")
        tokens = keras.Input(shape=(64,), name="tokens", dtype="int64")
        dense = keras.layers.Dense(width)(pixels)
        dense = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(dense))
        embedded = keras.layers.Flatten()(keras.layers.Embedding(17, 4)(tokens))
        joined = keras.layers.LayerNormalization()(keras.layers.Concatenate()([dense, embedded]))
        joined = keras.layers.Dropout(0.3)(keras.layers.Dense(32, activation="relu")(joined))
        return keras.Model({"pixels": pixels, "tokens": tokens}, keras.layers.Dense(10)(joined))


    def wide_model():
        return build_model(width=64)
''')


def run_cli(args, cwd, timeout=240, extra_env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TF_CPP_MIN_LOG_LEVEL")}
    env.update(extra_env or {})
    return subprocess.run([RAYTF, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def run_on_cluster(args, cwd, cluster, timeout=240, extra_env=None):
    """The console script with `--address` to the session's cluster (`cluster`: its fixture), where the path
    under test is not the embedded Ray's: a Ray start and stop less (~10 s of a loaded machine). That cluster
    runs without token auth; a token file in ~/.ray (an embedded Ray writes one) would make raytf send one."""
    return run_cli([*args, "--address", cluster[0].address], cwd=cwd, timeout=timeout,
                   extra_env={"RAY_AUTH_MODE": "disabled", **(extra_env or {})})


def files_under(folder: Path, skip: Path | None = None) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")
            if p.is_file() and not (skip is not None and p.is_relative_to(skip))}


@pytest.fixture
def project(tmp_path):
    """A user's project: jobs/ holds the job file, the model module and Parquet data (digits, plus an
    integer `tokens` column for the Embedding); results go to ../runs/<name>."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    jobs = tmp_path / "proj" / "jobs"
    (jobs / "data").mkdir(parents=True)
    (jobs / "stateful.py").write_text(STATEFUL_MODEL)
    for split in ("train", "test"):
        table = pq.read_table(DIGITS / f"digits-{split}.parquet")
        pixels = np.stack(table.column("pixels").to_numpy(zero_copy_only=False))
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.rint(pixels * 16).astype("int64").reshape(-1)), 64)
        pq.write_table(table.append_column("tokens", tokens), jobs / "data" / f"digits-{split}.parquet",
                       row_group_size=400)
    spec = base_spec(name="stateful", model="stateful:build_model",
                     data={"features": ["pixels", "tokens"]}, train={"epochs": 3, "global_batch_size": 64},
                     output={"dir": "../runs/stateful"})
    (jobs / "job.yaml").write_text(yaml.safe_dump(spec))
    return jobs


# ---------------------------------------------------------------- no Ray, no TensorFlow


def test_no_code_path_calls_a_bare_ray_init():
    """A bare ray.init() joins whatever cluster Ray last recorded in its temp dir, a dead one included."""
    bare = []
    for path in [*(REPO / "raytf").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "init"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"
                    and not any(k.arg == "address" for k in node.keywords)):
                bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bare


@pytest.mark.parametrize("override,says", [
    ("train.epoch=3", "train.epoch: unknown key"),
    ("train.epochs=many", "train.epochs: "),
    ("train.global_batch_size=65", "use 64 or 66"),
    ("data.train=data/nothing.parquet", "data.train: "),
    ("data.label=digit", "['digit'] not in"),
    ("model=digitz:build_model", "module 'digitz' not found"),
])
def test_a_spec_error_that_needs_no_tensorflow_is_found_without_importing_it(override, says):
    code = textwrap.dedent(f"""
        import sys
        from raytf import job as spec
        from raytf.errors import SpecError
        try:
            spec.load("jobs/digits.yaml", spec.parse_set_options([{override!r}]))
        except SpecError as exc:
            print(exc)
        print("tensorflow imported:", "tensorflow" in sys.modules, "keras imported:", "keras" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert says in proc.stdout, proc.stdout + proc.stderr
    assert "tensorflow imported: False keras imported: False" in proc.stdout


def test_a_bad_sweep_grid_is_found_without_importing_tensorflow():
    code = textwrap.dedent("""
        import sys
        from raytf import tuner
        from raytf.errors import SpecError
        try:
            tuner.prepare("jobs/digits-sweep.yaml", {"tune.space.train.global_batch_size": {"grid": [64, 99]}})
        except SpecError as exc:
            print(exc)
        print("tensorflow imported:", "tensorflow" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "point p02" in proc.stdout and "use 98 or 100" in proc.stdout, proc.stdout + proc.stderr
    assert "tensorflow imported: False" in proc.stdout


@pytest.mark.parametrize("args,says", [
    (["run", "digits.yaml", "--set", "data.label=digit"], "['digit'] not in"),
    (["run", "digits.yaml", "--set", "loss=nosuchloss"], "unknown Keras loss 'nosuchloss'"),  # imports TF
    (["tune", "digits-sweep.yaml", "--set", "optimizer.name=nosuchopt"], "cannot build 'nosuchopt'"),
])
def test_a_spec_error_is_the_only_line_on_stderr(args, says):
    proc = run_cli(args, cwd=REPO / "jobs", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("raytf: error: ") and says in lines[0], proc.stderr
    assert proc.stdout == ""


def test_verbose_brings_tensorflows_own_lines_back():
    proc = run_cli(["run", "digits.yaml", "--set", "loss=nosuchloss", "-v"], cwd=REPO / "jobs", timeout=120)
    assert proc.returncode == 2
    assert "oneDNN" in proc.stderr or "cuda" in proc.stderr.lower(), proc.stderr  # TF's import-time lines
    assert proc.stderr.splitlines()[-1].startswith("raytf: error: loss: unknown Keras loss")


def test_only_noise_is_filtered_from_stderr():
    from raytf.driver.quiet import without_noise

    text = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
            "I0000 00:00:1796282571.561262    4290 port.cc:153] oneDNN custom operations are on.\n"
            "E0000 00:00:1796282577.740544    4335 cuda_platform.cc:52] failed call to cuInit\n"
            "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
            "appropriate compiler flags.\n"
            "UserWarning: the user's own warning\n"
            "I0000 is not a log line\n")
    assert without_noise(text) == "UserWarning: the user's own warning\nI0000 is not a log line\n"


@pytest.mark.timeout(60)
def test_the_console_scripts_filter_covers_its_whole_life_and_keeps_the_terminal():
    """Native lines printed at any time (as when TensorFlow is first imported late, unpickling something of
    TensorFlow's a worker sent) are filtered; Python's lines and partial lines pass in order; sys.stderr still
    says it is a terminal (the live progress line). A TF_CPP_MIN_LOG_LEVEL of the user's own: no filter."""
    import pty

    code = textwrap.dedent("""
        import os, sys, time
        from raytf.driver import quiet
        on = quiet.filter_stderr(verbose=False)
        print("filter", on, "tty", sys.stderr.isatty(), flush=True)
        print("raytf: before", file=sys.stderr)
        time.sleep(0.2)
        os.write(2, b"I0000 00:00:1796282571.561262    4290 port.cc:153] oneDNN custom operations are on.\\n")
        print("\\rstep 1/9", end="", file=sys.stderr, flush=True)
        time.sleep(0.3)
        print("\\rstep 2/9", file=sys.stderr)
        os.write(2, b"E0000 00:00:1796282577.740544    4335 cuda_platform.cc:52] failed call to cuInit\\n")
        raise SystemExit("raytf: error: the end")
    """)
    for extra, filtered in (({}, True), ({"TF_CPP_MIN_LOG_LEVEL": "0"}, False)):
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        primary, secondary = pty.openpty()  # stderr is a terminal
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=secondary,
                              text=True, timeout=30, env={**env, **extra})
        os.close(secondary)
        seen = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            seen += chunk
        os.close(primary)
        stderr = seen.decode().replace("\r\n", "\n")
        assert proc.returncode == 1 and proc.stdout == f"filter {filtered} tty True\n"
        if filtered:
            assert stderr == "raytf: before\n\rstep 1/9\rstep 2/9\nraytf: error: the end\n", repr(stderr)
        else:
            assert "oneDNN" in stderr and "cuInit" in stderr


def test_a_job_folder_over_the_limit_names_its_largest_files_and_the_fix(tmp_path):
    from raytf.driver.packaging import check_size
    from raytf.errors import SpecError

    (tmp_path / "big.bin").write_bytes(b"x" * 3000)
    (tmp_path / "small.py").write_text("x = 1\n")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "huge.bin").write_bytes(b"x" * 9000)
    (tmp_path / ".rayignore").write_text("ignored/\n")
    assert check_size(tmp_path, [], limit=4000) == 3000 + 6 + len("ignored/\n")  # .rayignore'd files don't count
    with pytest.raises(SpecError) as info:
        check_size(tmp_path, [], limit=2000)
    message = str(info.value)
    assert "big.bin (0.0 MiB)" in message and "huge.bin" not in message
    assert ".rayignore" in message and "storage every node reads" in message


def test_an_explicit_address_sends_the_users_token(monkeypatch, tmp_path):
    from raytf.driver.session import auth_mode_for

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert auth_mode_for("10.0.0.1:6379") is None  # no token: nothing to send
    assert auth_mode_for(None) == "token"  # an embedded Ray makes its own token
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 64)
    assert auth_mode_for("10.0.0.1:6379") == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert auth_mode_for("10.0.0.1:6379") is None  # the user's own choice stands


# ---------------------------------------------------------------- the console script, on an embedded Ray


def assert_quiet(proc) -> None:
    """The terminal has raytf's lines only: no TensorFlow start-up noise, no Ray INFO lines, no worker logs."""
    for noise in ("oneDNN", "cuda", "absl", "Creating a file package", "Pushing file package", "TaskActor pid",
                  "INFO", "Started a local Ray"):
        assert noise not in proc.stderr, proc.stderr
    assert "raytf: workers' logs: " in proc.stderr


@pytest.mark.cluster
def test_tune_from_the_job_folder_runs_trials_in_kept_processes_and_its_best_spec_trains_the_same_from_elsewhere(
        cluster, project, tmp_path, mlflow):
    """`raytf tune --address` (the session's cluster) from inside the job folder: two trials, one after the other
    (max_concurrent_trials: 1), of models with state as users write them (BatchNormalization, Dropout, Embedding,
    LayerNormalization) in two widths: the second runs in the first's processes (TensorFlow's collectives re-formed
    over other shapes), and trains as in its own. MLflow (a real server) holds the sweep as a parent run with each
    trial's run nested in it. Then the best spec, as it is, runs from a folder that is not the job's, by the
    absolute path of a symlink to it (inside the job folder: the own-loop example's and tests/test_real_code.py's
    runs; from the repository root: .ci/run, the README's command verbatim): with another Ray cluster up (the test
    cluster), it still starts its own embedded Ray; every worker ends bit-identical, BatchNormalization's statistics
    included, and the saved model scores the validation rows as the run reported; it is a run of its own in the same
    experiment. Neither command leaves a file in the job folder or where the user stood."""
    import keras
    import numpy as np
    import pyarrow.parquet as pq

    test_cluster, gpu_nodes = cluster
    sweep = yaml.safe_load((project / "job.yaml").read_text())
    sweep.update(name="sweep", output={"dir": "../runs/sweep", "tensorboard": False},
                 tracking={"mlflow": {"uri": mlflow.uri, "experiment": "user-path-sweep"}},
                 tune={"metric": "val_loss", "mode": "min", "max_concurrent_trials": 1,
                       "space": {"model": {"grid": ["stateful:build_model", "stateful:wide_model"]}}})
    sweep["train"]["epochs"] = 1
    (project / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    before = files_under(project)
    proc = run_on_cluster(["tune", "sweep.yaml"], project, cluster)  # on an embedded Ray: test_tune's train_fn sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert files_under(project) == before  # the best spec too goes to output.dir
    out = project.parent / "runs" / "sweep"
    best = out / "best.yaml"
    assert best.is_file() and f"job spec {best}" in proc.stdout

    trials = [json.loads((out / "trials" / p / "result.json").read_text()) for p in ("p00", "p01")]
    assert [t["status"] for t in trials] == ["succeeded", "succeeded"]
    assert [t["processes_reused"] for t in trials] == [0, 2], "the second trial ran in the first's processes"
    assert [t["address"] for t in trials[1]["tasks"]] == [t["address"] for t in trials[0]["tasks"]]
    for trial in trials:  # each trained as in processes of its own: workers agree, the loss is a loss
        assert len({t["weights_digest"] for t in trial["tasks"]}) == 1
        assert 0 < trial["history"][-1]["val_loss"] < 2.3
    assert trials[1]["history"][-1]["val_loss"] != trials[0]["history"][-1]["val_loss"]

    parent, *nested = mlflow.runs("user-path-sweep")
    assert (parent.info.run_name, parent.info.status) == ("sweep", "FINISHED")
    assert mlflow.artifacts(parent.info.run_id) == ["best.yaml", "sweep.json", "sweep.png"]
    assert parent.data.params["tune.space.model.values"] == '["stateful:build_model", "stateful:wide_model"]'
    assert sorted(r.info.run_name for r in nested) == ["sweep-p00", "sweep-p01"]
    for trial in nested:
        assert trial.info.status == "FINISHED" and trial.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert [step for step, _ in mlflow.history(trial.info.run_id, "val_loss")] == [1]
        assert "model.keras" in mlflow.artifacts(trial.info.run_id)
    assert {r.data.params["model"] for r in nested} == {"stateful:build_model", "stateful:wide_model"}

    # the best spec runs as it is, from an unrelated folder, by the absolute path of a symlink to it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "linked.yaml").symlink_to(best)
    elsewhere_before = files_under(elsewhere)
    temp_before = task_files_in_temp_dir()
    proc = run_cli(["run", str(elsewhere / "linked.yaml"), "--set", "train.epochs=2"], cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert task_files_in_temp_dir() - temp_before == set()  # the embedded Ray's tasks took their files along

    ran = out / "best"  # the best spec's output.dir, beside the sweep's
    result = json.loads((ran / "result.json").read_text())
    assert result["status"] == "succeeded" and (ran / "model.keras").is_file()
    assert files_under(project) == before  # nothing new in the job folder: no zip, no __pycache__
    assert files_under(elsewhere) == elsewhere_before  # nor where the user stood
    assert f"result {ran}/result.json" in proc.stdout
    assert_quiet(proc)
    assert "epoch 2 done" in proc.stderr

    assert len({t["weights_digest"] for t in result["tasks"]}) == 1  # BatchNormalization's statistics included
    known = {gpu.node_id for gpu in gpu_nodes} | {test_cluster.head_node.node_id}
    assert not {t["node_id"] for t in result["tasks"]} & known  # not the test cluster's nodes: its own Ray
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < losses[0]
    model = keras.models.load_model(ran / "model.keras")
    table = pq.read_table(project / "data" / "digits-test.parquet")
    x = {name: np.stack(table.column(name).to_numpy(zero_copy_only=False)) for name in ("pixels", "tokens")}
    accuracy = float((model.predict(x, verbose=0).argmax(axis=1) == table.column("label").to_numpy()).mean())
    assert accuracy == pytest.approx(result["history"][-1]["val_accuracy"], abs=1e-6) and accuracy > 0.8
    again = mlflow.runs("user-path-sweep")[-1]
    assert again.info.status == "FINISHED" and "mlflow.parentRunId" not in again.data.tags


def test_data_inspect_reads_the_same_from_every_working_directory(project, tmp_path):
    shown = set()
    for cwd, path in ((project, "data/digits-train.parquet"), (project.parent, "jobs/data/digits-train.parquet"),
                      (tmp_path, str(project / "data" / "digits-train.parquet"))):
        proc = run_cli(["data", "inspect", path], cwd=cwd, timeout=60)
        assert proc.returncode == 0, proc.stderr
        shown.add(proc.stdout.replace(path, "PATH"))
    assert len(shown) == 1 and "1,437 rows" in shown.pop()


@pytest.mark.timeout(60)
def test_two_jobs_in_one_process_each_get_their_own_module_of_the_same_name(tmp_path):
    """A notebook runs one job, then another whose folder has its own `model.py`: each job's functions
    are checked in its own module, not in the one the first job imported."""
    from raytf.job import load

    for name, function in (("a", "build_a"), ("b", "build_b")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.py").write_text(f"import keras\n\ndef {function}():\n    return keras.Sequential("
                                         f"[keras.Input((1,)), keras.layers.Dense(1)])\n")
        (folder / "job.yaml").write_text(yaml.safe_dump({
            "name": name, "model": f"model:{function}", "dataset_fn": f"model:{function}",
            "train": {"steps_per_epoch": 1}, "loss": "mse"}))
    first = load(tmp_path / "a" / "job.yaml")
    second = load(tmp_path / "b" / "job.yaml")  # before the fix: "'model' has no function 'build_b'"
    assert first.job_dir.name == "a" and second.job_dir.name == "b"


# ---------------------------------------------------------------- failing jobs through the console script

FAILING_TRAIN_FN = textwrap.dedent('''
    def train(ctx):
        import tensorflow as tf  # not at the top: the driver never imports TensorFlow for this job itself

        raise tf.errors.InvalidArgumentError(None, None, "boom from the worker")
''')


@pytest.mark.timeout(180)
def test_a_failing_job_shows_only_raytfs_lines_and_leaves_earlier_runs_behind(job_dir, cluster):
    """A second job in a folder: the first run's outputs (runs/, and an output.dir of another name that holds
    a large file) stay behind; a large data file travels, said in raytf's words, not in Ray's. The worker
    fails with a TensorFlow error: no TensorFlow start-up line on the terminal, only raytf's."""
    (job_dir / "boom.py").write_text(FAILING_TRAIN_FN)
    spec = base_spec(model=None, train_fn="boom:train", train={"epochs": 1, "global_batch_size": 64},
                     cluster={"workers": 1})
    for key in ("loss", "optimizer", "metrics"):  # a train_fn job: no Keras name for the driver to check
        spec.pop(key)
    write_job(job_dir, spec)
    earlier = job_dir / "results" / "first"
    earlier.mkdir(parents=True)
    (earlier / "result.json").write_text(json.dumps({"name": "first", "strategy": "mirrored", "status": "succeeded",
                                                     "output_dir": str(earlier), "tasks": [], "history": []}))
    (earlier / "weights.bin").write_bytes(b"w" * 11 * 1024 ** 2)  # Ray would warn "File ... is very large"
    (job_dir / "data" / "big.bin").write_bytes(b"d" * 11 * 1024 ** 2)

    proc = run_on_cluster(["run", "job.yaml"], job_dir, cluster, timeout=150)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "boom.py:5: InvalidArgumentError: boom from the worker" in proc.stderr.splitlines()[-1], proc.stderr
    assert_quiet(proc)
    for ray_words in ("is very large", "ray.init(", "Ignoring upload", "weights.bin"):
        assert ray_words not in proc.stderr, proc.stderr
    assert f"raytf: uploading large files to every node: {job_dir / 'data' / 'big.bin'} (11.00MiB)" in proc.stderr
    assert all(line.startswith("raytf: ") for line in proc.stderr.splitlines()), proc.stderr
    assert (job_dir / "runs" / "t" / ".raytf-output").is_file()  # this run's output.dir, for the next job


@pytest.mark.timeout(120)
def test_an_impossible_request_on_the_embedded_ray_is_exit_3_at_once(job_dir):
    """An embedded local Ray cannot grow: a bundle it can never hold is exit 3 at once, not after
    cluster.reserve_timeout_s, with what was asked, what the machine has, and the fix."""
    import time

    write_job(job_dir, base_spec(cluster={"workers": 2, "cpus_per_worker": 64, "reserve_timeout_s": 120}))
    started = time.monotonic()
    proc = run_cli(["run", "job.yaml"], cwd=job_dir, timeout=110)
    elapsed = time.monotonic() - started
    assert proc.returncode == 3, proc.stderr[-3000:]
    error = proc.stderr.splitlines()[-1]
    assert error.startswith("raytf: error: the embedded local Ray (this machine only; it cannot grow) can never hold")
    assert "asked for 2 bundles of {CPU: 64} (total {CPU: 128}" in error and "the cluster has {CPU: " in error
    assert "lower cluster.workers or the per-worker resources" in error and "--address" in error
    assert "Traceback" not in proc.stderr
    assert elapsed < 60, elapsed  # Ray's start and stop only
