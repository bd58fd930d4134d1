"""What a task does with the user's code, without Ray or TensorFlow: the error it sends back names the user's
file and line (raytf.actor.raised), and each task runs in a working folder of its own (raytf.actor.workdir)."""
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from raytf.actor import raised
from raytf.driver.ray_group import describe, task_error
from raytf.errors import CheckpointCorrupt, SpecError, TaskException
from tests.conftest import base_spec

pytestmark = pytest.mark.timeout(60)


def test_the_users_line_is_the_deepest_frame_in_a_job_file(tmp_path, monkeypatch):
    job = str(tmp_path / "job")
    frames = [("/usr/lib/python3.11/runpy.py", 10), (f"{job}/train.py", 40), (f"{job}/lib/model.py", 7),
              ("/site-packages/keras/src/layers/core.py", 300), ("/tmp/__autograph_generated_filex.py", 3)]
    assert raised.user_line(frames, "", [job]) == os.path.join("lib", "model.py") + ":7"
    assert raised.user_line(frames[:2], "", ["/elsewhere", job]) == "train.py:40"
    # a traced tf.function's error: the Python stack shows AutoGraph's files; TensorFlow lists the user's in the text
    message = f'in user code:\n\n    File "{job}/train.py", line 12, in step\n        loss = boom()\n'
    assert raised.user_line(frames[3:], message, [job]) == "train.py:12"
    assert raised.user_line(frames[3:], "no file named", [job]) is None
    assert raised.user_line([(f"{job}x/other.py", 3)], "", [job]) is None  # a sibling folder is not the job's
    os.makedirs(job, exist_ok=True)
    monkeypatch.chdir(job)  # as the driver builds the model: "<frozen os>" is no file of the job folder
    assert raised.user_line([(f"{job}/model.py", 5), ("<frozen os>", 679)], "", [job]) == "model.py:5"


def test_a_captured_exception_keeps_type_message_line_and_traceback_across_pickling(tmp_path):
    (tmp_path / "usercode.py").write_text("def fit(metric):\n    metric.reset_states()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import usercode
        try:
            usercode.fit(object())
        except AttributeError as exc:
            captured = raised.capture(exc, [str(tmp_path)])
    finally:
        sys.path.remove(str(tmp_path))
    back = pickle.loads(pickle.dumps(captured))  # as Ray carries it from the actor
    assert isinstance(back, TaskException) and back.type_name == "AttributeError" and back.where == "usercode.py:2"
    assert "metric.reset_states()" in back.traceback
    assert describe(back) == "usercode.py:2: AttributeError: 'object' object has no attribute 'reset_states'"
    error = task_error(back)
    assert error.type_name == "AttributeError" and error.traceback == back.traceback and not error.actor_died
    # raytf's own errors pass as they are: the driver acts on their type
    corrupt = CheckpointCorrupt("/c/ckpt-1", "truncated")
    assert raised.capture(corrupt, [str(tmp_path)]) is corrupt


# One task: enters its own folder from the shared job folder, saves "./training_checkpoints/ckpt" five times
# (as TensorFlow's tutorial does on every worker), then lists what its working directory shows.
TASK = textwrap.dedent("""
    import os, sys, tempfile, time
    from raytf.actor import workdir
    job, rank = sys.argv[1], sys.argv[2]
    os.chdir(job)  # Ray starts every task of a node in the one unpacked job folder
    workdir.enter(job, tempfile.mkdtemp(prefix="task-") + "/work")
    import helper  # the job's modules still import
    assert open("data/rows.txt").read() == "1,2,3"  # and its files read as before
    for i in range(5):
        os.makedirs("training_checkpoints", exist_ok=True)
        with open(f"training_checkpoints/ckpt-{i}_temp", "w") as f:
            f.write(rank)
        time.sleep(0.02)
        os.replace(f"training_checkpoints/ckpt-{i}_temp", f"training_checkpoints/ckpt-{i}")
    open(f"rank-{rank}.txt", "w").close()
    time.sleep(0.3)
    mine = {open(f"training_checkpoints/ckpt-{i}").read() for i in range(5)}
    print(sorted(f for f in os.listdir(".") if f.startswith("rank-")), sorted(mine))
""")


def test_two_tasks_writing_the_same_relative_path_each_get_their_own(tmp_path):
    job = tmp_path / "job"
    (job / "data").mkdir(parents=True)
    (job / "data" / "rows.txt").write_text("1,2,3")
    (job / "helper.py").write_text("")
    procs = [subprocess.Popen([sys.executable, "-c", TASK, str(job), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=50) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["['rank-0.txt'] ['0']", "['rank-1.txt'] ['1']"]
    assert sorted(os.listdir(job)) == ["data", "helper.py"], "nothing written into the shared job folder"


def test_a_keras_layer_error_keeps_the_sentence_that_says_what_is_wrong():
    from raytf.actor.raised import summary

    keras_error = ("Exception encountered when calling Dense.call().\n\n\x1b[1mInput 0 of layer \"dense\" is "
                   "incompatible with the layer: expected axis -1 of input shape to have value 64, but received "
                   "input with shape (None, 32)\x1b[0m\n\nArguments received by Dense.call():\n  • inputs=tf.Tensor("
                   "shape=(None, 32), dtype=float32)\n  • kwargs=<class 'inspect._empty'>")
    for message in (keras_error, "Graph execution error:\n\nDetected at node x\n" + keras_error):
        line = summary(message)
        assert "is incompatible with the layer" in line and "kwargs" not in line and "\x1b" not in line, line


@pytest.mark.timeout(120)
def test_a_model_that_cannot_be_built_is_found_before_anything_starts_naming_its_line(tmp_path):
    import shutil

    import yaml

    from tests.conftest import DIGITS, base_spec
    from tests.test_user_paths import run_cli

    (tmp_path / "bad_model.py").write_text(textwrap.dedent("""
        import keras

        def build():
            return keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(10), keras.layers.Reshape((3, 3))])
    """))
    shutil.copytree(DIGITS, tmp_path / "data", ignore=shutil.ignore_patterns("*.py", "criteo*", "shapes*"))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(base_spec(model="bad_model:build")))
    proc = run_cli(["run", "job.yaml"], cwd=tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "raytf: error: model: bad_model:build cannot be built: bad_model.py:5: ValueError: Exception encountered when "
        "calling Reshape.call(). The total size of the tensor must be unchanged. Received: input_shape=(10,), "
        "target_shape=(3, 3)"], proc.stderr  # before Ray, reservation or any worker
    assert sorted(os.listdir(tmp_path)) == ["bad_model.py", "data", "job.yaml"]


@pytest.mark.timeout(120)
def test_a_label_the_models_output_cannot_take_is_a_spec_error_from_the_model_built_in_the_driver(job_dir):
    from raytf.job import load
    from tests.conftest import write_job

    path = write_job(job_dir, base_spec(loss={"name": "mse"}, metrics=["mae"]))  # tmodel outputs 10 numbers
    with pytest.raises(SpecError, match=r"loss: mse needs a label of the model's output shape, but label 'label' "
                                        r"is one number per row and the model outputs a vector of 10 numbers"):
        load(path)


def test_verbose_prints_the_failed_tasks_traceback_before_the_one_line(capsys):
    from raytf.console_exit import exit_on_error
    from raytf.errors import TrainingFailed

    failure = TrainingFailed("training failed: rank(s) 0: train.py:9: ValueError: boom",
                             traceback='Traceback (most recent call last):\n  File "train.py", line 9\nValueError: boom\n')
    for verbose in (False, True):
        with pytest.raises(SystemExit) as exited, exit_on_error(verbose=verbose):
            raise failure
        err = capsys.readouterr().err
        assert exited.value.code == 1 and err.endswith("raytf: error: training failed: rank(s) 0: train.py:9: "
                                                        "ValueError: boom\n")
        assert ('File "train.py", line 9' in err) is verbose


def test_ctrl_c_exits_130_and_sigterm_143_each_saying_interrupted(capsys):
    from raytf.console_exit import Terminated, exit_on_error

    for signalled, code, said in ((KeyboardInterrupt(), 130, "raytf: interrupted\n"),
                                  (Terminated(), 143, "raytf: interrupted (SIGTERM)\n")):
        with pytest.raises(SystemExit) as exited, exit_on_error():
            raise signalled
        assert exited.value.code == code and capsys.readouterr().err == said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("legacy", ["0", "1"])
def test_a_task_imports_tensorflow_without_scikit_learn_matplotlib_and_ipython_which_then_import_as_usual(legacy):
    """Keras 3 imports scikit-learn, matplotlib and IPython with TensorFlow (~1.5 CPU-s of every worker's start
    here), and TensorFlow SciPy (~0.15); a task's import (and the console script's) leaves them out, and the user's
    own imports afterwards work.
    Also under train.keras: legacy, where TensorFlow imports tf-keras and Keras 3 came later, with all three."""
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    pytest.importorskip("IPython")
    code = textwrap.dedent("""
        import sys
        from raytf import tf_import
        tf_import.import_tensorflow()
        left_out = not {"sklearn", "matplotlib", "IPython"} & set(sys.modules) and {"tensorflow", "keras"} <= set(sys.modules)
        left_out = left_out and ("scipy" in sys.modules) == LEGACY  # SciPy too, but where tf-keras decides on it
        import scipy.sparse
        assert scipy.sparse.issparse(scipy.sparse.csr_matrix([[1.0]]))
        import IPython
        from keras.src.saving import file_editor
        assert IPython.get_ipython() is None and file_editor.is_ipython_notebook() is False
        import sklearn.linear_model
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plt.plot([0, 1])
        print(left_out, round(float(sklearn.linear_model.LinearRegression().fit([[0], [1]], [0, 2]).coef_[0]), 6))
    """)
    proc = subprocess.run([sys.executable, "-c", f"LEGACY = {legacy == '1'}\n" + code], capture_output=True, text=True,
                          timeout=50,
                          env={**os.environ, "TF_USE_LEGACY_KERAS": legacy})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "True 2.0", proc.stdout


UNSAVABLE = textwrap.dedent('''
    import keras


    class RecommenderNet(keras.Model):  # keras-io's collaborative filtering model: arguments, no get_config
        def __init__(self, num_users, embedding_size, **kwargs):
            super().__init__(**kwargs)
            self.users = keras.layers.Embedding(num_users, embedding_size)
            self.out = keras.layers.Dense(10)

        def call(self, x):
            return self.out(keras.ops.mean(self.users(keras.ops.cast(x, "int32")), axis=1))


    def build():
        return RecommenderNet(num_users=64, embedding_size=4)
''')


@pytest.mark.timeout(120)
def test_a_model_that_cannot_be_saved_as_model_keras_is_found_before_it_trains(job_dir):
    """keras-io's collaborative filtering model trained every epoch and then failed in model.save: it is found when
    the driver builds the model, naming the fix; exporting only a SavedModel needs no get_config."""
    from raytf.job import load
    from tests.conftest import write_job

    (job_dir / "unsavable.py").write_text(UNSAVABLE)
    path = write_job(job_dir, base_spec(model="unsavable:build"))
    with pytest.raises(SpecError, match=r"output.export: keras: the model from unsavable:build cannot be saved as "
                                        r"model.keras \(NotImplementedError: .*get_config\(\).*\); give RecommenderNet "
                                        r"a get_config\(\) returning its __init__ arguments, or export only a SavedModel"):
        load(path)
    load(write_job(job_dir, base_spec(model="unsavable:build", output={"export": ["saved_model"]})))


@pytest.mark.parametrize("role, cpus, threads", [("worker", 0.5, (1, 2)), ("ps", 0.25, (1, 2)), ("worker", 1, (1, 2)),
                                                 ("chief", 3, (3, 3))])
def test_a_tasks_thread_pools_follow_the_cpus_it_reserved_one_thread_and_no_spinning_for_a_fraction(role, cpus, threads,
                                                                                                  monkeypatch):
    """TensorFlow's pools default to one thread per core in every process: workers sharing a node's cores each
    spawn a pool per core (three 0.5-CPU processes on 2 cores: 1.6x the CPU per step, benchmarks/
    bench_fractional_threads.py); their idle threads spinning for the next op take what the neighbours need.
    Inter-op stays at 2 or more: a collective blocks its thread while it waits."""
    from types import SimpleNamespace

    from raytf.actor.task_actor import _configure_process
    from raytf.job import parse

    set_to = {}
    threading = SimpleNamespace(set_intra_op_parallelism_threads=lambda n: set_to.__setitem__("intra", n),
                                set_inter_op_parallelism_threads=lambda n: set_to.__setitem__("inter", n))
    tf = SimpleNamespace(config=SimpleNamespace(threading=threading, list_physical_devices=lambda kind: []))
    parameter_servers = role != "worker"  # ps and chief tasks are the parameter-server strategy's
    cluster = {"workers": 2, f"cpus_per_{role}": cpus, **({"ps": 1} if parameter_servers else {})}
    spec = parse({"name": "t", "model": "m:f", "dataset_fn": "m:d", "cluster": cluster,
                  **({"strategy": "parameter_server"} if parameter_servers else {}),
                  "train": {"global_batch_size": 8, "steps_per_epoch": 4, "deterministic": False}})
    from raytf.actor import task_actor

    monkeypatch.setattr(task_actor, "_disable_thread_spinning", lambda: set_to.__setitem__("spinning", False))
    monkeypatch.delenv("TF_GRPC_DEFAULT_OPTIONS", raising=False)  # set by the call; put back after the test
    _configure_process(tf, SimpleNamespace(role=role), spec)
    assert (set_to["intra"], set_to["inter"]) == threads
    assert set_to.get("spinning", True) == (cpus >= 1)  # a fraction of a core: idle pool threads do not spin
    assert "grpc.initial_reconnect_backoff_ms=50" in os.environ["TF_GRPC_DEFAULT_OPTIONS"]


def test_grpc_retries_a_peer_not_yet_up_after_50_ms_and_a_users_own_grpc_options_win():
    """gRPC's first retry of a peer whose server was not up yet waits 1 s: every strategy start paid it."""
    from raytf.actor.task_actor import grpc_default_options

    assert grpc_default_options(None) == "grpc.initial_reconnect_backoff_ms=50"  # not the connect deadline
    assert grpc_default_options("grpc.min_reconnect_backoff_ms=200,grpc.keepalive_time_ms=9") == (
        "grpc.min_reconnect_backoff_ms=200,grpc.keepalive_time_ms=9,grpc.initial_reconnect_backoff_ms=50")


def test_the_tasks_keras_is_the_one_the_spec_names_whatever_the_drivers_environment_says(job_dir, monkeypatch):
    """An embedded Ray's actors inherit the driver's environment: TF_USE_LEGACY_KERAS=1 there made tf.keras tf-keras
    (and Keras 3 a late import) in the tasks of a job whose spec says Keras 3."""
    from raytf.driver.packaging import runtime_env
    from raytf.job import load
    from tests.conftest import write_job

    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert runtime_env(load(write_job(job_dir, base_spec())))["env_vars"]["TF_USE_LEGACY_KERAS"] == "0"


def test_a_survivors_state_starts_the_restart_unless_a_deterministic_run_keeps_more_than_its_weights():
    # BatchNormalization's statistics and Dropout's random state hold the failed step's forward pass on a survivor:
    # train.deterministic promises bit-for-bit resumes, which only a checkpoint then gives
    import keras

    from raytf.actor.mirrored import survivor_state_is_exact

    def model(*layers):
        return keras.Sequential([keras.Input((4,)), *layers, keras.layers.Dense(2)])

    plain, normalized, dropped = model(), model(keras.layers.BatchNormalization()), model(keras.layers.Dropout(0.5))
    assert all(survivor_state_is_exact(m, deterministic=False) for m in (plain, normalized, dropped))
    assert survivor_state_is_exact(plain, deterministic=True)
    assert not survivor_state_is_exact(normalized, deterministic=True)
    assert not survivor_state_is_exact(dropped, deterministic=True)


def test_a_survivor_still_leaving_its_failed_step_is_waited_for_and_one_whose_train_returned_is_not():
    """rescue_point on a busy machine: a survivor whose train call has not yet left its failed step (its state not
    yet kept) answered None at once, and the restart went back to the last checkpoint, steps lost."""
    import threading
    import time
    import types

    from raytf.actor.task_actor import TaskActor

    actor = TaskActor.__new__(TaskActor)  # its two fields at stake only: no process, no TensorFlow
    actor._ctx, actor._training = types.SimpleNamespace(rescue=None), True
    threading.Timer(0.3, setattr, (actor._ctx, "rescue", types.SimpleNamespace(step=42))).start()
    assert actor.rescue_point(leave_s=10) == 42  # kept on its way out, 0.3 s in
    actor._ctx.rescue, actor._training = None, False
    started = time.monotonic()
    assert actor.rescue_point(leave_s=10) is None and time.monotonic() - started < 1  # returned without a state
    actor._training = True
    started = time.monotonic()
    assert actor.rescue_point(leave_s=0.3) is None and time.monotonic() - started >= 0.3  # no state in time
