"""Labels as Keras takes them: fixed-size numeric label vectors (one-hot, multi-output regression) go
through raytf's loop; a label whose shape disagrees with the loss (or the model's output) is a spec error
naming the label's shape and the loss that fits; the reported loss is Keras's (the model's own losses in)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from raytf import data, data_scan
from raytf.actor import shard_reader
from raytf.errors import SpecError
from raytf.job import load
from raytf.labels import check_label_shape, loss_key
from tests.conftest import DIGITS, MODEL_MODULE, base_spec, fill_job_folder, write_job


def one_hot_digits(folder, split: str, integer: bool = False) -> str:
    """jobs/data/digits-<split>.parquet with its label one-hot (fixed_size_list<float>[10], as
    keras.utils.to_categorical gives; list<int64> with `integer`)."""
    table = pq.read_table(DIGITS / f"digits-{split}.parquet")
    labels = table.column("label").to_numpy()
    eye = np.eye(10, dtype=np.int64 if integer else np.float32)[labels]
    one_hot = (pa.array(list(eye), pa.list_(pa.int64())) if integer
               else pa.FixedSizeListArray.from_arrays(pa.array(eye.reshape(-1)), 10))
    path = folder / f"onehot-{split}.parquet"
    pq.write_table(table.append_column("onehot", one_hot), path, row_group_size=500)
    return str(path)


def regression_digits(folder, split: str) -> str:
    """digits with a 3-number regression target per row (list<double>, equal lengths): the mean ink of
    the image's top, middle and bottom thirds, and the label's id kept beside it."""
    table = pq.read_table(DIGITS / f"digits-{split}.parquet")
    pixels = np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).reshape(-1, 8, 8)
    target = np.stack([pixels[:, :3].mean(axis=(1, 2)), pixels[:, 3:5].mean(axis=(1, 2)),
                       pixels[:, 5:].mean(axis=(1, 2))], axis=1) * 10.0
    path = folder / f"regression-{split}.parquet"
    pq.write_table(table.append_column("target", pa.array(list(target.astype(np.float64)), pa.list_(pa.float64()))),
                   path, row_group_size=500)
    return str(path)


@pytest.fixture
def labelled(job_dir):
    """The job folder with one-hot and regression variants of the digits beside the originals."""
    return add_label_variants(job_dir)


def add_label_variants(folder):
    for split in ("train", "test"):
        one_hot_digits(folder / "data", split)
        regression_digits(folder / "data", split)
    return folder


def one_hot_spec(**sections):
    sections = {"loss": {"name": "categorical_crossentropy", "from_logits": True}, **sections}
    return base_spec(data={"train": "data/onehot-train.parquet", "validation": "data/onehot-test.parquet",
                           "features": ["pixels"], "label": "onehot"}, **sections)


# ---------------------------------------------------------------- pure: data and spec, no TensorFlow


@pytest.mark.timeout(30)
def test_label_vectors_are_described_and_read_as_rows_of_their_width(tmp_path):
    path = one_hot_digits(tmp_path, "test")
    info = data_scan.read_info(path, ["pixels"], "onehot")
    assert info.label == data.Column("onehot", "float32", (10,)) and info.label.values == "float"
    columns = [np.concatenate(parts) for parts in zip(*shard_reader.iter_shard(info, path, data.plan_shards(
        [p.num_rows for p in info.pieces], 1)[0]))]
    labels = pq.read_table(DIGITS / "digits-test.parquet").column("label").to_numpy()
    assert columns[1].shape == (360, 10) and columns[1].dtype == np.float32
    assert (columns[1].argmax(axis=1) == labels).all() and (columns[1].sum(axis=1) == 1).all()

    regression = regression_digits(tmp_path, "test")  # list<double> of equal lengths: shape from the first row group
    info = data_scan.read_info(regression, ["pixels"], "target")
    assert info.label == data.Column("target", "float32", (3,))
    (tmp_path / "int").mkdir()
    integer = one_hot_digits(tmp_path / "int", "train", integer=True)
    assert data_scan.read_info(integer, ["pixels"], "onehot").label.values == "integer"


@pytest.mark.timeout(30)
def test_string_and_ragged_labels_are_still_refused(tmp_path):
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": ["cat", "dog"]}), tmp_path / "s.parquet")
    with pytest.raises(SpecError, match=r"label 'y' has type string; the label must be numbers: one per row, or a "
                                        r"fixed-size list of them \(map string classes to integer ids first\)"):
        data_scan.read_info(str(tmp_path / "s.parquet"), ["x"], "y")
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": [[1.0, 0.0], [1.0]]}), tmp_path / "r.parquet")
    with pytest.raises(SpecError, match="column 'y' is ragged"):
        data_scan.read_info(str(tmp_path / "r.parquet"), ["x"], "y")


@pytest.mark.timeout(30)
def test_a_one_hot_job_and_a_regression_job_load(labelled):
    job = load(write_job(labelled, one_hot_spec()), check_code=False)
    assert job.datasets["train"].label.shape == (10,) and job.datasets["validation"].label.shape == (10,)
    spec = base_spec(data={"train": "data/regression-train.parquet", "validation": "data/regression-test.parquet",
                           "features": ["pixels"], "label": "target"}, loss="mse", metrics=["mae"])
    assert load(write_job(labelled, spec), check_code=False).datasets["train"].label.shape == (3,)
    # the class name of the loss is the same loss
    assert load(write_job(labelled, one_hot_spec(loss="CategoricalCrossentropy")), check_code=False)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("label,loss,message", [
    ("onehot", "sparse_categorical_crossentropy",
     "loss: sparse_categorical_crossentropy takes one class id per row, but label 'onehot' is a vector of 10 "
     "numbers per row (one-hot?); use loss: categorical_crossentropy (or write the class id, the vector's argmax)"),
    ("label", "categorical_crossentropy",
     "loss: categorical_crossentropy takes one-hot label vectors, but label 'label' is one number per row (a class "
     "id?); use loss: sparse_categorical_crossentropy, or write the label one-hot as a fixed-size list "
     "(keras.utils.to_categorical)"),
    ("label", "CategoricalCrossentropy", "use loss: sparse_categorical_crossentropy"),
    ("label", "categorical_hinge", "use loss: sparse_categorical_crossentropy"),
])
def test_a_label_the_loss_cannot_take_is_a_spec_error_suggesting_the_loss(labelled, label, loss, message):
    spec = one_hot_spec(loss=loss)
    spec["data"]["label"] = label
    with pytest.raises(SpecError) as caught:
        load(write_job(labelled, spec), check_code=False)
    assert str(caught.value) == message if message.startswith("loss:") else message in str(caught.value)


@pytest.mark.timeout(30)
def test_validation_must_have_the_train_labels_shape_and_a_preprocess_defers_the_check(labelled):
    spec = one_hot_spec()
    pq.write_table(pq.read_table(labelled / "data/regression-test.parquet").rename_columns(["pixels", "label", "onehot"]),
                   labelled / "data/short.parquet")
    spec["data"]["validation"] = "data/short.parquet"
    with pytest.raises(SpecError, match=r"^data.validation: label 'onehot' is a vector of 3 numbers per row, but a "
                                        r"vector of 10 numbers per row in data.train; write both with one shape$"):
        load(write_job(labelled, spec), check_code=False)
    # a preprocess may one-hot the label itself: the check waits for the model's output, at the first step
    (labelled / "prep.py").write_text("def prep(example):\n    return example\n")
    spec = base_spec(loss="categorical_crossentropy", data={"preprocess": "prep:prep"})
    assert load(write_job(labelled, spec), check_code=False).datasets["train"].label.shape == ()


@pytest.mark.timeout(30)
def test_the_label_is_checked_against_the_models_output_shape():
    def refused(*args, **kwargs):
        with pytest.raises(SpecError) as caught:
            check_label_shape(*args, **kwargs)
        return str(caught.value)

    assert refused("categorical_crossentropy", "y", (10,), (5,)) == (
        "loss: categorical_crossentropy needs a label of the model's output shape, but label 'y' is a vector of 10 "
        "numbers per row and the model outputs a vector of 5 numbers per row; make the model's last layer 10 wide "
        "(or fix the label)")
    assert "label 'y' is a vector of 3 numbers per row and the model outputs one number per row" in refused(
        "mse", "y", (3,), ())
    assert "label 'y' is one number per row and the model outputs a vector of 4" in refused("mae", "y", (), (4,))
    # an integer one-hot passes the metadata check; the model's output tells
    check_label_shape("sparse_categorical_crossentropy", "y", (10,), values="integer")
    assert "use loss: categorical_crossentropy" in refused("sparse_categorical_crossentropy", "y", (10,), (10,))
    assert "plus a last axis of classes, but label 'y' is a vector of 7 numbers per row and the model outputs a " \
           "vector of 10" in refused("sparse_categorical_crossentropy", "y", (7,), (10,))
    for ok in [("sparse_categorical_crossentropy", "y", (), (10,)),         # class ids
               ("sparse_categorical_crossentropy", "y", (1,), (10,)),       # class ids as [batch, 1]
               ("sparse_categorical_crossentropy", "y", (12,), (12, 5)),    # a class per position (tokens)
               ("binary_crossentropy", "y", (), (1,)),                      # aligned by raytf
               ("binary_crossentropy", "y", (5,), (5,)),                    # multi-label
               ("categorical_crossentropy", "y", (10,), (10,)),
               ("MeanSquaredError", "y", (3,), (3,)),
               ("mse", "y", (3,), (None,)),                                 # unknown: not checked
               ("ctc", "y", (8,), (20, 30))]:                               # not a loss raytf knows shapes of
        check_label_shape(*ok)
    assert loss_key("SparseCategoricalCrossentropy") == "sparse_categorical_crossentropy"
    assert loss_key("categorical_crossentropy") == "categorical_crossentropy"


@pytest.mark.timeout(30)
def test_inspect_says_a_one_hot_column_is_a_categorical_label(tmp_path):
    report = data_scan.inspect_report(one_hot_digits(tmp_path, "test"))
    assert ("  onehot: fixed_size_list<element: float>[10] -> float32 tensor[10], one-hot over 10 classes in the first "
            "row group (as the label: loss categorical_crossentropy, metric accuracy)") in report
    assert "  pixels: fixed_size_list<element: float>[64] -> float32 tensor[64]\n" in report  # not one-hot
    regression = data_scan.inspect_report(regression_digits(tmp_path, "test"))
    assert "double> -> float32 tensor[3] (from the first row group)\n" in regression  # not one-hot


@pytest.mark.timeout(120)
def test_the_cli_refuses_a_one_hot_label_with_the_sparse_loss_in_one_line(labelled):
    from raytf.cli import main

    spec = one_hot_spec(loss={"name": "sparse_categorical_crossentropy", "from_logits": True})
    result = CliRunner().invoke(main, ["run", str(write_job(labelled, spec))])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "label 'onehot' is a vector of 10 numbers per row (one-hot?)" in lines[0], lines
    assert "use loss: categorical_crossentropy" in lines[0]


# ---------------------------------------------------------------- in-process TensorFlow: 2 replicas, no Ray

TWO_REPLICAS = textwrap.dedent('''
    import json, sys, types
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras
    import numpy as np
    from raytf.job import load
    from raytf.protocol import WorkerPayload
    from raytf.actor import steps

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    job_dir, tasks = sys.argv[1], json.loads(sys.argv[2])  # one process, one TensorFlow start-up, for them all
    sys.path.insert(0, job_dir)


    def train(job_file, epochs):
        """raytf's loop for the mirrored strategy (its runner), epoch by epoch, as loop.run drives it."""
        from raytf.actor.mirrored import MirroredRunner

        job = load(job_file)
        payload = WorkerPayload(job.spec, job.datasets["train"], job.data_path(job.spec.data.train),
                                job.datasets["validation"], job.data_path(job.spec.data.validation))
        ctx = types.SimpleNamespace(world_size=1, rank=0, is_chief=True, staging_dir=job_dir + "/staging")
        runner = MirroredRunner(strategy, payload, ctx)
        history = []
        for epoch in range(1, epochs + 1):
            runner.start_epoch(epoch, None)
            for _ in runner.train(runner.steps, epoch):
                pass
            metrics = runner.train_acc.results(runner.epoch_totals())
            metrics.update({f"val_{k}": v for k, v in runner.eval_acc.results(runner.validate()).items()})
            history.append(metrics)
        return {"history": history, "metrics": {n: type(m).__name__ for n, m in runner.train_acc.metrics.items()},
                "digest": steps.weights_digest(runner.model)}


    def regularized_step(job_file):
        """One optimizer step of raytf's train step on 64 fixed rows over 2 replicas (and train.accumulation_steps
        micro-batches each), against the same step computed by hand on one device from Keras's definition of
        the loss: the data loss's mean plus sum(model.losses)."""
        job = load(job_file)
        spec, k = job.spec, job.spec.train.accumulation_steps
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 64)).astype(np.float32)
        y = rng.integers(0, 10, size=64)
        with strategy.scope():
            model = WorkerPayload(spec).function("model")()
            optimizer = keras.optimizers.SGD(0.5)
            optimizer.build(model.trainable_variables)
        start = [w.copy() for w in model.get_weights()]
        train_acc = steps.Accumulator(steps.build_metrics(spec))
        eval_acc = steps.Accumulator(steps.build_metrics(spec))
        fns = steps.make_step_functions(strategy, model, optimizer, steps.build_loss(spec), train_acc, eval_acc, spec)
        per_replica = 64 // 2

        def rows(ctx):  # replica r: rows [32r, 32r + 32), as k stacked micro-batches
            parts = tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica // k)
            return (parts.batch(k) if k > 1 else parts).repeat()
        fns.train(iter(strategy.distribute_datasets_from_function(rows)))
        reported = train_acc.results(train_acc.total.numpy())["loss"]

        plain = WorkerPayload(spec).function("model")()
        plain.set_weights(start)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        with tf.GradientTape() as tape:
            data_loss = loss_fn(y, plain(x, training=True))
            keras_loss = data_loss + tf.add_n(plain.losses)
        grads = tape.gradient(keras_loss, plain.trainable_variables)
        expected = [w - 0.5 * g for w, g in zip(plain.trainable_variables, grads)]

        check = WorkerPayload(spec).function("model")()  # Keras's own evaluate, on the stepped weights
        check.set_weights(model.get_weights())
        check.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        evaluated = check.evaluate(x, y, batch_size=64, verbose=0)
        eval_acc.total.assign(tf.zeros_like(eval_acc.total))
        fns.evaluate(iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((x, y, np.ones(64, np.float32))).repeat())))
        return {"reported": reported, "keras_loss": float(keras_loss), "data_loss": float(data_loss),
                "regularization": float(tf.add_n(plain.losses)),
                "weights_gap": max(float(np.abs(w.numpy() - v).max()) for w, v in zip(expected, model.get_weights())),
                "step": max(float(np.abs(w - v).max()) for w, v in zip(start, model.get_weights())),
                "val_loss": eval_acc.results(eval_acc.total.numpy())["loss"], "keras_evaluate": float(evaluated)}


    print(json.dumps([train(task["job"], task["epochs"]) if task["kind"] == "train" else regularized_step(task["job"])
                      for task in tasks]))
''')


def two_replicas(job_dir, *tasks):
    """Each task's outcome, the tasks run one after another in one process (each job seeds its own run)."""
    proc = subprocess.run([sys.executable, "-c", TWO_REPLICAS, str(job_dir), json.dumps(tasks)], capture_output=True,
                          text=True, timeout=240, cwd=job_dir, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


REGRESSOR = textwrap.dedent('''
    def build_regressor():
        return keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dense(3)])
''')

REGULARIZED = textwrap.dedent('''
    import keras

    def build_regularized():
        return keras.Sequential([keras.Input(shape=(64,)),
                                 keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05)),
                                 keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(0.05))])
''')


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory):
    """The 2-replica outcomes the tests below read, run in one TensorFlow process (its start is most of each):
    the digits with class ids and with one-hot labels (2 epochs each), a 3-output regression (3 epochs), and one
    step of an L2-regularized model with 1, then 2 micro-batches per replica."""
    folder = add_label_variants(fill_job_folder(tmp_path_factory.mktemp("labels"), MODEL_MODULE + REGRESSOR))
    (folder / "treg.py").write_text(REGULARIZED)
    ids = one_hot_spec(loss={"name": "sparse_categorical_crossentropy", "from_logits": True})
    ids["data"]["label"] = "label"  # the same files (so the same row groups, so the same order): the class ids
    regression = base_spec(data={"train": "data/regression-train.parquet",
                                 "validation": "data/regression-test.parquet", "features": ["pixels"],
                                 "label": "target"}, model="tmodel:build_regressor", loss="mse", metrics=["mae"])
    tasks = {"sparse": {"kind": "train", "epochs": 2, "spec": ids},
             "one_hot": {"kind": "train", "epochs": 2, "spec": one_hot_spec()},
             "regression": {"kind": "train", "epochs": 3, "spec": regression}}
    for k in (1, 2):
        tasks[f"step_k{k}"] = {"kind": "step", "spec": base_spec(
            model="treg:build_regularized", train={"global_batch_size": 64 // k, "accumulation_steps": k})}
    for name, task in tasks.items():
        task["job"] = str(write_job(folder, task.pop("spec"), f"{name}.yaml"))
    outcomes = two_replicas(folder, *tasks.values())
    return folder, dict(zip(tasks, outcomes))


@pytest.mark.timeout(300)
def test_one_hot_labels_with_categorical_crossentropy_train_like_class_ids_with_the_sparse_loss(replica_runs):
    """The same digits, seed and order: one-hot + categorical_crossentropy and class ids + the sparse loss
    are the same loss, so raytf's loop (2 replicas) trains them to the same accuracy, epoch for epoch;
    'accuracy' resolves to the accuracy that reads each label."""
    _, runs = replica_runs
    sparse, one_hot = runs["sparse"], runs["one_hot"]
    assert sparse["metrics"] == {"accuracy": "SparseCategoricalAccuracy"}
    assert one_hot["metrics"] == {"accuracy": "CategoricalAccuracy"}
    assert len(sparse["history"]) == len(one_hot["history"]) == 2
    for a, b in zip(sparse["history"], one_hot["history"]):
        assert a["examples"] == b["examples"] == 22 * 64 and a["val_examples"] == b["val_examples"] == 360
        assert a["accuracy"] == b["accuracy"] and a["val_accuracy"] == b["val_accuracy"], (a, b)  # (measured: equal)
        for key in ("loss", "val_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a, b)  # float rounding apart
    assert one_hot["history"][-1]["val_accuracy"] > 0.9 and sparse["history"][-1]["val_accuracy"] > 0.9


@pytest.mark.timeout(300)
def test_a_multi_output_regression_label_trains_with_mse(replica_runs):
    folder, runs = replica_runs
    out = runs["regression"]
    target = np.stack(pq.read_table(folder / "data/regression-test.parquet").column("target").to_numpy(
        zero_copy_only=False))
    baseline_mae = float(np.abs(target - target.mean(axis=0)).mean())  # predicting each output's mean
    first, last = out["history"][0], out["history"][-1]
    assert out["metrics"] == {"mae": "MeanAbsoluteError"}
    assert len(out["history"]) == 3 and last["val_mae"] < 0.5 * baseline_mae, (last, baseline_mae)
    assert last["loss"] < first["loss"] and last["val_examples"] == 360


@pytest.mark.timeout(300)
def test_the_reported_loss_and_the_gradient_count_the_regularizers_as_keras_does_with_and_without_accumulation(
        replica_runs):
    """An L2 kernel_regularizer, 2 replicas (with 1, then 2 micro-batches each): one step moves the weights as
    the gradient of Keras's loss (data loss mean + sum(model.losses)) on one device does, the regularizers
    counted once; the reported loss and validation loss are Keras's (the latter: model.evaluate's)."""
    _, runs = replica_runs
    for out in (runs["step_k1"], runs["step_k2"]):
        assert out["regularization"] > 0.2 * out["data_loss"], out  # large enough that leaving it out shows
        assert out["reported"] == pytest.approx(out["keras_loss"], rel=1e-5), out
        assert out["weights_gap"] < 1e-5 < out["step"], out  # the step is Keras's loss's gradient step
        assert out["val_loss"] == pytest.approx(out["keras_evaluate"], rel=1e-5), out


@pytest.mark.timeout(120)
def test_the_first_step_checks_the_label_against_the_models_output():
    """What Parquet metadata cannot tell (an integer one-hot with the sparse loss, a label wider than the
    model's output) the loss function checks when the step is traced: a SpecError naming both shapes,
    not a shape error from inside Keras; labels that fit pass, a (batch,) label against (batch, 1) too."""
    import tensorflow as tf

    from raytf.actor import steps
    from raytf.job import parse

    def loss(name, label_shape, output_shape, label_dtype=tf.float32):
        fn = steps.build_loss(parse(one_hot_spec(loss=name)))
        traced = tf.function(lambda y, pred: fn(y, pred)).get_concrete_function(
            tf.TensorSpec((None, *label_shape), label_dtype), tf.TensorSpec((None, *output_shape), tf.float32))
        return traced.structured_outputs.shape.as_list()

    with pytest.raises(SpecError, match=r"^loss: sparse_categorical_crossentropy takes one class id per row, but "
                                        r"label 'onehot' is a vector of 10 numbers per row \(one-hot\?\); use loss: "
                                        r"categorical_crossentropy"):
        loss("sparse_categorical_crossentropy", (10,), (10,))
    with pytest.raises(SpecError, match=r"label 'onehot' is a vector of 10 numbers per row and the model outputs a "
                                        r"vector of 5 numbers per row; make the model's last layer 10 wide"):
        loss("categorical_crossentropy", (10,), (5,))
    assert loss("categorical_crossentropy", (10,), (10,)) == [None]
    assert loss("sparse_categorical_crossentropy", (), (10,), tf.int64) == [None]
    assert loss("mse", (3,), (3,)) == [None]
