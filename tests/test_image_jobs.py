"""Images and tensors in real jobs: the CNN example job (PNG bytes in Parquet, decoded and augmented in
tf.data) run the way users run it, and a tensor column through a preprocess function on every
MultiWorkerMirrored worker and on every parameter-server worker."""
import json
import shutil

import keras
import numpy as np

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytf.driver.controller import run
from raytf.errors import TrainingFailed
from raytf.job import load
from tests.conftest import REPO, assert_nothing_left, task_files_in_temp_dir, write_job
from tests.serving import feed_of, serve_in_a_fresh_process
from tests.test_parameter_server import CHIEF_CRASHED
from tests.test_user_paths import assert_quiet, files_under, run_cli, run_on_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420), pytest.mark.flaky(reruns=1, only_rerun=[CHIEF_CRASHED])]


def test_the_cnn_job_trains_on_two_workers_to_identical_weights(tmp_path, cluster):
    """jobs/shapes.yaml as written (8 epochs) from inside a copy of jobs/, on the session's cluster (`--address`).
    Not fewer: at epoch 5 the validation accuracy was 0.746 on one machine (training 0.976; epoch 6: 0.996),
    run after run, and >= 0.9 on another: oneDNN's numerics differ with the CPU's instructions."""
    jobs = tmp_path / "jobs"
    shutil.copytree(REPO / "jobs", jobs, ignore=shutil.ignore_patterns("__pycache__", "criteo-*"))
    before = files_under(jobs)
    proc = run_on_cluster(["run", "shapes.yaml"], jobs, cluster, timeout=400,
                          extra_env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "runs" / "shapes" / "result.json").read_text())
    history = result["history"]
    assert history[-1]["loss"] < history[0]["loss"] / 3
    assert history[-1]["val_accuracy"] >= 0.9, history  # trained
    assert [h["val_examples"] for h in history] == [480] * 8  # every picture once, each epoch
    assert len({t["weights_digest"] for t in result["tasks"]}) == 1 and len(result["tasks"]) == 2
    assert files_under(jobs) == before  # nothing new in the job folder
    assert_quiet(proc)


TENSOR_MODEL = '''
import keras
import tensorflow as tf


def build_model():
    return keras.Sequential([keras.Input(shape=(8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(10)])


def unshift(example):
    """The stored labels are the digit + 10: a worker whose examples skipped this would fail the loss. The
    pixels come as the tensor column, or decoded from the PNG column."""
    pixels = tf.cast(example["png"], tf.float32) / 255.0 if "png" in example else example["pixels"]
    return {"pixels": pixels, "label": example["label"] - 10}


def broken(example):
    return {"pixels": example["pixels"].numpy(), "label": example["label"]}
'''


@pytest.fixture(scope="module")
def tensor_job(tmp_path_factory):
    """Digits as an 8x8x1 tensor column (Arrow's fixed_shape_tensor) and as PNG bytes, labels shifted by 10."""
    import sys

    sys.path.insert(0, str(REPO / "jobs"))
    from make_shapes import png

    folder = tmp_path_factory.mktemp("tensors")
    (folder / "tensormodel.py").write_text(TENSOR_MODEL)
    for split in ("train", "test"):
        table = pq.read_table(REPO / "jobs" / "data" / f"digits-{split}.parquet")
        pixels = table.column("pixels").combine_chunks()
        tensor = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), (8, 8, 1)), pixels)
        grey = np.round(pixels.flatten().to_numpy().reshape(-1, 8, 8, 1) * 255).astype(np.uint8)
        encoded = pa.array([png(np.repeat(g, 3, axis=-1)) for g in grey], pa.binary())
        labels = pa.array(table.column("label").to_numpy() + 10)
        pq.write_table(pa.table({"pixels": tensor, "png": encoded, "label": labels}), folder / f"{split}.parquet",
                       row_group_size=300)
    return folder


def tensor_spec(folder, strategy, preprocess="tensormodel:unshift"):
    """Mirrored: the tensor column, cached on disk; parameter servers: the PNG column decoded, cached in memory."""
    cluster = {"workers": 2, "cpus_per_worker": 0.5, "reserve_timeout_s": 30}
    columns = {"features": ["pixels"], "cache": "disk"}
    export = ["keras"]
    if strategy == "parameter_server":
        cluster.update(ps=1, cpus_per_ps=0.25, cpus_per_chief=0.25)
        columns = {"features": ["png"], "decode": {"column": "png", "format": "png", "channels": 1}, "cache": "memory"}
        export = ["keras", "saved_model"]
    return {"name": f"tensors-{strategy}", "strategy": strategy, "model": "tensormodel:build_model",
            "data": {"train": "train.parquet", "validation": "test.parquet", "label": "label",
                     "preprocess": preprocess, **columns},
            "loss": {"name": "sparse_categorical_crossentropy", "from_logits": True},
            "optimizer": {"name": "adam", "learning_rate": 0.01}, "metrics": ["accuracy"],
            "train": {"epochs": 2, "global_batch_size": 64, "seed": 0}, "cluster": cluster,
            "output": {"tensorboard": False, "export": export}}


@pytest.mark.parametrize("strategy", ["mirrored", "parameter_server"])
def test_a_tensor_column_goes_through_the_preprocess_function_on_every_worker(cluster, tensor_job, strategy,
                                                                              tmp_path):
    temp_before = task_files_in_temp_dir()
    result = run(load(write_job(tensor_job, tensor_spec(tensor_job, strategy), name=f"{strategy}.yaml")))
    assert result.status == "succeeded"
    assert task_files_in_temp_dir() - temp_before == set()  # mirrored: the disk cache went; ps: every task's folder
    losses = [h["loss"] for h in result.history]
    assert losses[-1] < losses[0] and result.history[-1]["val_accuracy"] > 0.8
    assert result.history[-1]["val_examples"] == 360
    if strategy == "mirrored":
        assert len({t["weights_digest"] for t in result.tasks}) == 1
    else:  # the workers ran the chief's steps, their pipelines holding the preprocess function
        assert [t["role"] for t in result.tasks] == ["chief", "ps", "worker", "worker"]
        # the SavedModel takes the PNG bytes and decodes and preprocesses inside: as the trained model scores
        feed = feed_of(str(tensor_job / "test.parquet"), ["png"], "label")
        feed = {"png": feed["png"][:64]}
        served, info = serve_in_a_fresh_process(result.exports["saved_model"], feed, tmp_path)
        assert info == {"raytf_imported": False, "inputs": ["png"], "outputs": ["output"]}
        import tensorflow as tf

        pixels = np.stack([tf.io.decode_png(b, channels=1).numpy() for b in feed["png"]]).astype(np.float32) / 255
        expected = keras.models.load_model(result.model_path)(pixels, training=False)
        np.testing.assert_allclose(served, keras.ops.convert_to_numpy(expected), rtol=1e-4, atol=1e-4)
    assert_nothing_left()


def test_a_preprocess_function_that_cannot_be_traced_fails_before_training_naming_it(cluster, tensor_job):
    spec = {**tensor_spec(tensor_job, "mirrored", "tensormodel:broken"), "name": "tensors-broken"}
    spec["cluster"] = {**spec["cluster"], "workers": 1}  # fails before the first step: one worker shows it
    job = load(write_job(tensor_job, spec, name="broken.yaml"))
    with pytest.raises(TrainingFailed, match=r"data.preprocess tensormodel:broken cannot run inside tf.data "
                                             r"\(AttributeError: .*numpy.*\); it runs as a TensorFlow graph") as failed:
        run(job)
    saved = json.loads((tensor_job / "runs" / "tensors-broken" / "result.json").read_text())
    assert saved["status"] == "failed" and saved["history"] == [] and saved["restarts"] == []  # no step, no retry
    assert_nothing_left()
