"""Real jobs on a local multi-node Ray cluster (ray.cluster_utils.Cluster): two GPU nodes with logical
GPUs, real actors, real TF gRPC between them, real Parquet, real files written."""
import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import ray

import raytf
from raytf.driver import controller
from raytf.driver.ray_group import RayWorkerGroup
from raytf.errors import PlacementTimeout, TrainingFailed
from raytf.job import load
from tests.conftest import REPO, assert_nothing_left, base_spec, write_job
from tests.mlflow_server import sha256

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_two_workers_on_two_gpu_nodes_train_to_identical_weights(cluster, job_dir, mlflow):
    """...and the run is in MLflow (a real server): params, a point per epoch, the model, FINISHED."""
    _, gpu_nodes = cluster
    spec = base_spec(name="two-nodes", train={"epochs": 3, "global_batch_size": 64},
                     cluster={"workers": 2, "cpus_per_worker": 0.5, "gpus_per_worker": 1, "placement": "strict_spread"},
                     tracking={"mlflow": {"uri": mlflow.uri, "experiment": "two-gpu-nodes"}})
    result = raytf.fit(write_job(job_dir, spec))

    assert result.status == "succeeded"
    nodes = {t["node_id"] for t in result.tasks}
    assert nodes == {n.node_id for n in gpu_nodes}  # spread over both GPU nodes, none on the head
    for task in result.tasks:  # each actor sees exactly its own logical GPU
        assert len(task["gpu_ids"]) == 1 and task["cuda_visible_devices"] == task["gpu_ids"][0]
    assert [t["rank"] for t in result.tasks] == [0, 1] and result.tasks[0]["role"] == "chief"
    digests = {t["weights_digest"] for t in result.tasks}
    assert len(digests) == 1  # bit-identical weights on every worker

    losses = [h["loss"] for h in result.history]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.5
    assert all(h["examples"] == 1437 // 64 * 64 for h in result.history)  # remainder dropped, as documented
    assert all(h["val_examples"] == 360 for h in result.history)  # every validation row, once
    assert result.history[-1]["val_accuracy"] > 0.8

    saved = json.loads((job_dir / "runs" / "two-nodes" / "result.json").read_text())
    for key in ("name", "strategy", "status", "tasks", "history", "examples_per_s", "model_path"):
        assert key in saved
    assert saved["history"] == result.history and saved["examples_per_s"] > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (job_dir / "runs" / "two-nodes" / "tensorboard").iterdir())

    [run] = mlflow.runs("two-gpu-nodes")
    # a training experiment, not filed under MLflow 3's GenAI view (the tag its UI's own selector sets)
    assert mlflow.client().get_experiment_by_name("two-gpu-nodes").tags["mlflow.experimentKind"] == \
        "custom_model_development"
    assert run.info.status == "FINISHED" and run.info.run_name == "two-nodes"
    assert run.data.params["train.epochs"] == "3" and run.data.params["cluster.placement"] == "strict_spread"
    assert run.data.params["tracking.mlflow.uri"] == mlflow.uri  # the spec as it ran (no secret can be in it)
    assert mlflow.history(run.info.run_id, "val_loss") == [(h["epoch"], h["val_loss"]) for h in result.history]
    assert mlflow.artifacts(run.info.run_id) == ["model.keras", "result.json"]
    logged_model = mlflow.download(run.info.run_id, "model.keras")
    assert sha256(logged_model) == sha256(job_dir / "runs" / "two-nodes" / "model.keras")

    import keras
    import numpy as np

    model = keras.models.load_model(logged_model)  # the model MLflow keeps loads
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    assert weights.size > 0 and np.isfinite(weights).all()
    assert_nothing_left()


def test_asking_for_more_gpus_than_exist_exits_3_within_the_timeout(cluster, job_dir):
    c, _ = cluster
    path = write_job(job_dir, base_spec(train={"global_batch_size": 60},
                                        cluster={"workers": 2, "gpus_per_worker": 3, "cpus_per_worker": 0.5,
                                                 "reserve_timeout_s": 3}))
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "run", str(path), "--address", c.address],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "asked for 2 bundles of {CPU: 0.5, GPU: 3}" in proc.stderr
    assert "the cluster has {CPU: 3, GPU: 4}" in proc.stderr and "No single node has the GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.time() - started < 90
    with pytest.raises(PlacementTimeout):  # the library raises the same error
        raytf.fit(path, {"cluster.reserve_timeout_s": 1})
    assert_nothing_left()


def test_per_node_gpus_mixed_bfloat16_and_xla_read_a_multi_file_directory_exactly_once_per_epoch_with_pad(
        cluster, job_dir):
    """One worker on each GPU node with all its GPUs, 16-bit compute under XLA, over a directory of three
    Parquet files of uneven row groups with data.remainder: pad (the padded batches keep XLA's shapes)."""
    import pyarrow.parquet as pq

    _, gpu_nodes = cluster
    table = pq.read_table(job_dir / "data" / "digits-train.parquet")
    parts = job_dir / "parts"
    parts.mkdir()
    for i, (start, stop, group) in enumerate([(0, 100, 30), (100, 1000, 256), (1000, 1437, 77)]):
        pq.write_table(table.slice(start, stop - start), parts / f"part-{i}.parquet", row_group_size=group)
    spec = base_spec(data={"train": "parts", "remainder": "pad"},
                     train={"epochs": 2, "global_batch_size": 64, "precision": "mixed_bfloat16", "jit_compile": True},
                     cluster={"workers": 2, "cpus_per_worker": 0.5, "gpus_per_worker": 2, "gpu_placement": "per_node"})
    result = raytf.fit(write_job(job_dir, spec))
    assert [h["examples"] for h in result.history] == [1437, 1437]  # every row, once, each epoch
    assert [h["step"] for h in result.history] == [23, 46]  # ceil(719 rows / 32 per worker) steps per epoch
    assert {t["node_id"] for t in result.tasks} == {n.node_id for n in gpu_nodes}  # one worker per node
    assert all(sorted(t["cuda_visible_devices"].split(",")) == ["0", "1"] for t in result.tasks)  # all its GPUs
    assert len({t["weights_digest"] for t in result.tasks}) == 1
    losses = [h["loss"] for h in result.history]
    assert losses[1] < losses[0]
    import keras

    model = keras.models.load_model(result.model_path)
    assert model.layers[0].dtype_policy.name == "mixed_bfloat16"  # 16-bit compute, float32 weights
    assert all(w.dtype == "float32" for w in model.get_weights())
    assert_nothing_left()


class PortThiefGroup(RayWorkerGroup):
    """Steals rank 1's port between the rendezvous and TensorFlow's bind, once."""

    stolen: list = []

    def setup(self, tasks, payload, timeout_s):
        if not PortThiefGroup.stolen:
            victim = tasks[1]
            ray.get(self.actors[victim.bundle_index].release_port.remote())
            thief = socket.socket()
            thief.bind(("", victim.port))
            thief.listen()
            PortThiefGroup.stolen.append((thief, victim.port))
        return super().setup(tasks, payload, timeout_s)


FAILING_MODEL = textwrap.dedent('''
    import json, os
    from tmodel import build_model as _build

    def build_model():
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            raise ValueError("boom on rank 1")
        return _build()
''')


def test_one_failing_worker_fails_the_job_fast_with_its_rank_and_cause(cluster, job_dir, mlflow):
    (job_dir / "failing.py").write_text(FAILING_MODEL)
    path = write_job(job_dir, base_spec(model="failing:build_model",
                                        tracking={"mlflow": {"uri": mlflow.uri, "experiment": "failing"}}))
    started = time.time()
    with pytest.raises(TrainingFailed) as info:
        raytf.fit(path)
    message = str(info.value)
    assert message.startswith("training failed: rank(s) 1: failing.py:7: ValueError: boom on rank 1"), message
    assert info.value.causes["failing.py:7: ValueError: boom on rank 1"] == [1]
    assert time.time() - started < 120  # rank 0, left waiting in a collective, was torn down
    saved = json.loads((job_dir / "runs" / "t" / "result.json").read_text())
    assert saved["status"] == "failed" and "boom on rank 1" in saved["error"]
    [run] = mlflow.runs("failing")  # MLflow says so too, and keeps the result with its cause
    assert run.info.status == "FAILED" and mlflow.artifacts(run.info.run_id) == ["result.json"]
    assert "boom on rank 1" in json.loads(mlflow.download(run.info.run_id, "result.json").read_text())["error"]
    assert_nothing_left()


ESCAPE_HATCHES = textwrap.dedent('''
    import numpy as np
    import tensorflow as tf
    import keras

    def dataset_fn(input_context):
        rng = np.random.default_rng(input_context.input_pipeline_id)
        x = rng.normal(size=(512, 4)).astype("float32")
        y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32")).reshape(-1, 1)
        batch = input_context.get_per_replica_batch_size(32)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)

    def linear():
        return keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(1)])
''')


def test_a_port_taken_before_tensorflow_binds_it_costs_a_fresh_rendezvous_and_a_dataset_fn_feeds_raytfs_loop(
        cluster, job_dir):
    """Rank 1's port is taken between the rendezvous and TensorFlow's bind: a fresh rendezvous, not the job. The
    job's input is a dataset_fn (raytf's loop, an endless stream cut at train.steps_per_epoch)."""
    (job_dir / "hatch.py").write_text(ESCAPE_HATCHES)
    spec = base_spec(model="hatch:linear", dataset_fn="hatch:dataset_fn", loss="mse", metrics=["mae"],
                     optimizer={"name": "sgd", "learning_rate": 0.05},
                     train={"epochs": 3, "global_batch_size": 32, "steps_per_epoch": 20})
    spec.pop("data")
    try:
        result = controller.run(load(write_job(job_dir, spec)), group_cls=PortThiefGroup)
    finally:
        for thief, _ in PortThiefGroup.stolen:
            thief.close()
    assert PortThiefGroup.stolen, "the thief never struck"
    assert result.status == "succeeded" and result.rendezvous_attempts == 2
    assert PortThiefGroup.stolen[0][1] not in [int(t["address"].rsplit(":", 1)[1]) for t in result.tasks]
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.2
    assert all(h["examples"] == 20 * 32 for h in result.history)
    assert len({t["weights_digest"] for t in result.tasks}) == 1
    assert_nothing_left()
