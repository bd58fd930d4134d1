"""Code written for plain tf.distribute, run as a migrating user runs it: the console script from the job
folder, on the embedded local Ray (one node, so both workers share the node and, before each task had a
folder of its own, one working directory) where that matters (the tutorial's own files, a signal to the
process group), else with `--address` to the session's cluster (a Ray start and stop less: ~5 s each).

- TensorFlow's custom-training tutorial in its shape: its own MirroredStrategy loop, its metrics'
  `reset_states()` and `checkpoint.save('./training_checkpoints/ckpt')` every second epoch on every worker.
  Under train.keras: legacy it runs as written (strategy from ctx, data from the job's Parquet); under Keras 3
  it fails on a Keras 2 name, and the one error line names the file and line.
- A tf.keras `fit` whose epochs each outlast failure.hang_timeout_s three times, then a wait that never ends:
  the fit is not declared hung, the wait is, and the failed result.json keeps the fit's epochs.
- SIGTERM (`ray job stop`, `kill`) and SIGINT (Ctrl-C) sent to the console script mid-training: one path,
  exit 143 or 130, the "interrupted" line, result.json `interrupted` with the epochs done.
"""
import json
import re
import os
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from tests.conftest import DIGITS, MODEL_MODULE, base_spec
from tests.ray_head import child_pids, group_pids, still_running
from tests.test_user_paths import RAYTF, run_cli, run_on_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

# The tutorial's structure and calls; what changed for raytf is marked "raytf:".
TUTORIAL = '''
import os

import numpy as np
import pyarrow.parquet as pq
import tensorflow as tf


def load(path):  # raytf: the job's Parquet (digits, 8x8) instead of downloading Fashion-MNIST (28x28)
    table = pq.read_table(path)
    images = np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).reshape(-1, 8, 8, 1) / 16.0
    return tf.image.resize(images, (28, 28)).numpy().astype("float32"), table.column("label").to_numpy()


def train(ctx):
    strategy = ctx.strategy  # raytf: the tutorial makes a MirroredStrategy of its own
    (train_images, train_labels), (test_images, test_labels) = load("data/train.parquet"), load("data/test.parquet")

    BUFFER_SIZE = len(train_images)
    BATCH_SIZE_PER_REPLICA = 32
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = ctx.spec.train.epochs  # raytf: from the job spec

    train_dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)
    test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    def create_model():
        return tf.keras.Sequential([
            tf.keras.layers.Conv2D(16, 3, activation="relu", input_shape=(28, 28, 1)),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu", kernel_regularizer=tf.keras.regularizers.L2(1e-4)),
            tf.keras.layers.Dense(10),
        ])

    checkpoint_dir = "./training_checkpoints"
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

    with strategy.scope():
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        test_loss = tf.keras.metrics.Mean(name="test_loss")
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        model = create_model()
        optimizer = tf.keras.optimizers.Adam()
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        test_loss.update_state(loss_object(labels, predictions))
        test_accuracy.update_state(labels, predictions)

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    for epoch in range(EPOCHS):
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches
        for x in test_dist_dataset:
            distributed_test_step(x)
        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)
        # raytf: a probe, not the tutorial's: which ranks' files this task's working directory shows
        open(f"rank-{ctx.rank}.txt", "w").close()
        ranks_seen = len([f for f in os.listdir(".") if f.startswith("rank-")])
        ctx.report({"loss": float(train_loss), "accuracy": float(train_accuracy.result()),  # raytf: per epoch
                    "val_accuracy": float(test_accuracy.result()), "ranks_seen": ranks_seen,
                    "checkpoint": tf.train.latest_checkpoint(checkpoint_dir)})
        test_loss.reset_states()  # KERAS2-ONLY
        train_accuracy.reset_states()
        test_accuracy.reset_states()
'''

# A tf.keras script's fit (train.keras: legacy) reporting once per epoch, then stuck. Its steps are slow
# computation (a batch ends no sooner than its share of EPOCH_S, the process busy meanwhile, as with a big model).
SLOW_FIT_THEN_STUCK = '''
import time

import tensorflow as tf

EPOCH_S, STEPS = 9.0, 20


class SlowSteps(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.time()

    def on_train_batch_end(self, batch, logs=None):
        while time.time() < self.started + (batch + 1) * EPOCH_S / STEPS:
            sum(i * i for i in range(10_000))


def train(ctx):
    with ctx.strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(256, activation="relu"),
                                     tf.keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ctx.distributed_dataset("train"), epochs=ctx.spec.train.epochs, steps_per_epoch=STEPS, verbose=0,
              callbacks=[SlowSteps(), tf.keras.callbacks.LambdaCallback(
                  on_epoch_end=lambda epoch, logs: ctx.report(logs))])
    time.sleep(3600)  # stuck: no computation, no report
'''


def job_folder(root, name, module, spec_lines):
    folder = root / name
    (folder / "data").mkdir(parents=True)
    shutil.copy2(DIGITS / "digits-train.parquet", folder / "data" / "train.parquet")
    shutil.copy2(DIGITS / "digits-test.parquet", folder / "data" / "test.parquet")
    (folder / f"{name}.py").write_text(module)
    (folder / "job.yaml").write_text("\n".join([
        f"name: {name}", f"train_fn: {name}:train",
        "data: {train: data/train.parquet, validation: data/test.parquet, features: [pixels], label: label}",
        "cluster: {workers: 2, cpus_per_worker: 0.5}", "output: {dir: ../runs}", *spec_lines]) + "\n")
    return folder


def line_of(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("real")


def test_the_custom_training_tutorial_runs_as_written_under_legacy_and_workers_never_share_files(root):
    folder = job_folder(root, "custom_training", TUTORIAL,
                        ["train: {epochs: 9, global_batch_size: 64, seed: 0, keras: legacy}"])
    proc = run_cli(["run", "job.yaml"], cwd=folder, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((root / "runs" / "result.json").read_text())
    history = result["history"]
    # five saves of ./training_checkpoints/ckpt by both workers on one node, each into its own folder
    assert [h["checkpoint"].split("/")[-1] for h in history[::2]] == [f"ckpt-{i}" for i in range(1, 6)]
    assert {h["ranks_seen"] for h in history} == {1}, "a task saw another task's files"
    assert history[-1]["loss"] < history[0]["loss"] and history[-1]["val_accuracy"] > 0.8, history[-1]
    # nothing the tasks wrote lands among the job's files
    assert sorted(os.listdir(folder)) == ["custom_training.py", "data", "job.yaml"]


def test_a_failure_in_user_code_names_its_file_and_line_on_one_line_and_in_result_json(root, cluster):
    # Keras 3: the first epoch trains, then the tutorial's Keras 2 `reset_states()` fails
    folder = job_folder(root, "custom_training_k3", TUTORIAL, ["train: {epochs: 2, global_batch_size: 64}"])
    proc = run_on_cluster(["run", "job.yaml"], folder, cluster, timeout=220)
    assert proc.returncode == 1, proc.stderr[-3000:]
    where = f"custom_training_k3.py:{line_of(TUTORIAL, 'KERAS2-ONLY')}"
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("raytf: error:")]
    assert len(error_lines) == 1 and f"{where}: AttributeError:" in error_lines[0], proc.stderr[-3000:]
    assert "'Mean' object has no attribute 'reset_states'" in error_lines[0]
    result = json.loads((root / "runs" / "result.json").read_text())
    assert result["status"] == "failed" and where in result["error"]
    assert f'custom_training_k3.py", line {line_of(TUTORIAL, "KERAS2-ONLY")}' in result["traceback"]
    assert [t["rank"] for t in result["tasks"]] == [0, 1]
    assert [e["epoch"] for e in result["history"]] == [1], "the epoch reported before the failure is kept"


def test_a_fit_longer_than_the_hang_timeout_lives_and_a_stuck_train_fn_is_caught_keeping_its_epochs(root, cluster):
    folder = job_folder(root, "slow_fit", SLOW_FIT_THEN_STUCK,
                        ["train: {epochs: 1, global_batch_size: 64, keras: legacy}",
                         "failure: {hang_timeout_s: 4, max_restarts: 0}"])
    started = time.monotonic()
    proc = run_on_cluster(["run", "job.yaml"], folder, cluster, timeout=220)
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads((root / "runs" / "result.json").read_text())
    assert "training hung: no progress from" in result["error"] and "for 4s" in result["error"], result["error"]
    epochs = result["history"]
    assert [e["epoch"] for e in epochs] == [1], "the failed run keeps the epoch it trained"
    assert epochs[0]["seconds"] >= 2 * 4, f"the epoch must outlast the hang timeout 2x: {epochs}"
    assert result["restarts"] == [] and [t["rank"] for t in result["tasks"]] == [0, 1]
    assert time.monotonic() - started < 200
    # before the teardown, each rank said where it was: the script's own line, and its stacks are kept
    stuck_at = f"slow_fit.py:{line_of(SLOW_FIT_THEN_STUCK, 'time.sleep(3600)')} in train"
    [named] = result["hangs"]
    # A rank may be named still inside model.fit: under loaded clean-clone runs (2026-12-07) the chief, and once rank
    # 1, had not left fit when every rank looked idle for the 4-s timeout (a process starved of CPU uses as little
    # as a stuck one, and a rank waiting for it in fit's last collective as little again). Either is its own line.
    in_fit = f"slow_fit.py:{line_of(SLOW_FIT_THEN_STUCK, 'model.fit(')} in train"
    said = [line.split(": ", 1)[1] for line in named["lines"]]
    assert all(s in (f"user code at {stuck_at}", f"user code at {in_fit}") for s in said), named
    line = re.search(r"raytf:   rank 1 \(worker, .*no progress\): user code at (slow_fit\.py:\d+) in train",
                     proc.stderr)
    assert line and f"user code at {line[1]} in train" == said[1], proc.stderr[-3000:]
    code = SLOW_FIT_THEN_STUCK.splitlines()[int(line[1].split(":")[1]) - 1].strip()  # its stack shows that line
    assert code in (root / "runs" / named["folder"] / "rank-1.txt").read_text()


# SIGTERM, the signal that skipped the Ctrl-C path (ray.init replaced raytf's handler); SIGINT is Python's own
# KeyboardInterrupt into the same path, its exit code 130 checked in test_task_code. Sent to the whole process
# group, as `timeout` and Slurm send it. The embedded Ray's processes are in groups of their own, so the signal
# reaches the driver alone: in its group the raylet died of it too, and the driver's Ray client then ended the
# process with exit 1 and no word when the Ctrl-C path was slower than the raylet (once, under load). Every one
# of them is gone after the driver's exit.
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143)])
def test_a_signal_takes_the_ctrl_c_path_and_result_json_keeps_the_epochs(root, sig, code):
    folder = job_folder(root, f"signalled_{code}", "", [])
    (folder / "job.yaml").write_text(yaml.safe_dump(base_spec(
        name=f"signalled-{code}", model="tmodel:build_model", output={"dir": "../runs"},
        data={"train": "data/train.parquet", "validation": "data/test.parquet", "features": ["pixels"],
              "label": "label"}, train={"epochs": 200, "global_batch_size": 64},
        cluster={"workers": 1})))  # nothing here counts ranks: one worker process fewer
    (folder / "tmodel.py").write_text(MODEL_MODULE)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TF_CPP_MIN_LOG_LEVEL")}
    proc = subprocess.Popen([RAYTF, "run", "job.yaml"], cwd=folder, env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("epoch 2 done"):
                in_group = [pid for pid in group_pids(proc.pid) if pid != proc.pid]
                ray_processes = child_pids(proc.pid)
                os.killpg(proc.pid, sig)
                break
        rest = proc.communicate(timeout=40)[1]
    finally:
        proc.kill()
    said = "".join(seen) + rest
    assert proc.returncode == code, said[-3000:]
    assert in_group == [] and len(ray_processes) >= 2, (in_group, ray_processes)  # the GCS and the raylet at least
    left = still_running(ray_processes, wait_s=5)
    assert left == [], f"the embedded Ray's processes outlived the driver: {left}"
    assert "raytf: interrupted; actors and placement group released" in said
    assert "*** SIGTERM received" not in said and "Fatal Python error" not in said, said[-3000:]  # no C++ dump
    result = json.loads((root / "runs" / "result.json").read_text())
    assert result["status"] == "interrupted" and len(result["history"]) >= 2, result


def test_a_diverging_job_stops_at_the_first_nan_epoch_and_exports_nothing(root, cluster):
    folder = job_folder(root, "diverging", "", [])
    (folder / "job.yaml").write_text(yaml.safe_dump(base_spec(
        name="diverging", model="tmodel:build_model", output={"dir": "../runs"},
        data={"train": "data/train.parquet", "validation": "data/test.parquet", "features": ["pixels"],
              "label": "label"}, optimizer={"name": "sgd", "learning_rate": 1e12}, train={"epochs": 5},
        cluster={"workers": 1})))  # the chief finds the nan; one worker is enough
    (folder / "tmodel.py").write_text(MODEL_MODULE)
    proc = run_on_cluster(["run", "job.yaml"], folder, cluster, timeout=220)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the loss is nan at epoch 1, step 22 (rank 0)" in proc.stderr or \
        "the loss is inf at epoch 1, step 22 (rank 0)" in proc.stderr, proc.stderr[-3000:]
    result = json.loads((root / "runs" / "result.json").read_text())  # strict JSON, or this would not parse
    assert result["status"] == "failed" and not (root / "runs" / "model.keras").exists()
