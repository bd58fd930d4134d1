"""Parameter servers run the user's code: a train_fn on the chief (ctx.strategy the ParameterServerStrategy,
ctx.coordinator its ClusterCoordinator) in the style of TensorFlow's parameter-server tutorial, with
checkpoints, the job's data and a fixed-length list<string> feature; a tf.keras script shaped like that
tutorial under train.keras: legacy, its model.fit included; and a dataset_fn under raytf's loop."""
import random
import textwrap

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytf.driver.controller import run
from raytf.job import load
from tests.conftest import assert_nothing_left, base_spec, write_job

# TF 2.21's ClusterCoordinator can segfault the chief while workers run their first steps (see
# tests/test_parameter_server.py): a job whose chief died that way runs once more.
CHIEF_CRASHED = r"TrainingFailed: training failed: chief 0 \(rank 0, [^)]*\): rank\(s\) 0: actor died"
# A task process that died before it reported in, its node alive: seen once in a clean-clone CI (the legacy
# tf.keras tutorial's chief bundle; its raylet saw the worker's socket close, as a native crash leaves it). Its
# cause is unknown; the job fails as it should (max_restarts 0), and the test runs once more.
DIED_STARTING = r"TrainingFailed: training failed: workers failed to report in: bundle \d+: actor died"



def cluster_job(timeout_s):
    """A test that runs real jobs on the session's Ray cluster (and may run once more after that crash)."""
    def mark(test):
        for m in (pytest.mark.cluster, pytest.mark.timeout(timeout_s),
                  pytest.mark.flaky(reruns=1, only_rerun=[CHIEF_CRASHED, DIED_STARTING])):
            test = m(test)
        return test
    return mark


# The tutorial's toy data: 3 of 7 words per row, the label "yes" (0) when "avenger" is among them.
FEATURE_VOCAB = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
TRAIN_ROWS, VAL_ROWS, BATCH = 640, 200, 32
STEPS_PER_EPOCH = TRAIN_ROWS // BATCH

# A ClusterCoordinator loop as TensorFlow's tutorial writes it, in Keras 3, on raytf's ctx: the strategy
# and coordinator come from ctx, the per-worker iterator from ctx.distributed_dataset, checkpoints from
# ctx.checkpoint. The words are hashed in the model (a stateless layer: nothing to create per worker).
KERAS3_LOOP = textwrap.dedent('''
    import keras
    import numpy as np
    import tensorflow as tf

    def build_model():
        words = keras.Input(shape=(3,), dtype="string", name="features")
        vectors = keras.layers.Embedding(1024, 8)(keras.layers.Hashing(1024)(words))
        return keras.Model(words, keras.layers.Dense(1, activation="sigmoid")(keras.ops.mean(vectors, axis=1)))

    def lowercase(example):  # data.preprocess: per row, on the workers (ctx.dataset) and the chief (validation)
        return {**example, "features": tf.strings.lower(example["features"])}

    def train(ctx):
        strategy, coordinator = ctx.strategy, ctx.coordinator
        assert isinstance(coordinator, tf.distribute.coordinator.ClusterCoordinator)
        assert tf.distribute.coordinator.ClusterCoordinator(strategy) is coordinator  # one per strategy
        with strategy.scope():
            model = ctx.build_model()
            optimizer = keras.optimizers.Adam(learning_rate=0.02)
            optimizer.build(model.trainable_variables)
            accuracy = keras.metrics.BinaryAccuracy()
        checkpoint = ctx.checkpoint(model=model, optimizer=optimizer)
        restored = checkpoint.restore()  # the step of the checkpoint a resume starts from; None when fresh
        step = restored or 0
        loss_fn = keras.losses.BinaryCrossentropy(reduction=None)

        @tf.function
        def step_fn(iterator):
            def replica_fn(batch_data, labels):
                labels = tf.cast(tf.reshape(labels, (-1, 1)), tf.float32)
                with tf.GradientTape() as tape:
                    pred = model(batch_data, training=True)
                    loss = tf.nn.compute_average_loss(loss_fn(labels, pred))
                gradients = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(gradients, model.trainable_variables))
                accuracy.update_state(labels, pred)
                return loss

            batch_data, labels = next(iterator)
            losses = strategy.run(replica_fn, args=(batch_data, labels))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        per_worker_iterator = iter(ctx.distributed_dataset("train", skip=step))
        for epoch in range(step // ctx.steps_per_epoch + 1, ctx.spec.train.epochs + 1):
            accuracy.reset_state()
            losses = [coordinator.schedule(step_fn, args=(per_worker_iterator,)) for _ in range(ctx.steps_per_epoch)]
            coordinator.join()
            step += ctx.steps_per_epoch
            ctx.step(step)
            val = keras.metrics.BinaryAccuracy()  # direct evaluation, on the chief: every validation row once
            for x, y, w in ctx.dataset("validation"):
                val.update_state(tf.reshape(y, (-1, 1)), model(x, training=False), sample_weight=w)
            ctx.report({"loss": float(np.mean([l.fetch() for l in losses])), "accuracy": float(accuracy.result()),
                        "val_accuracy": float(val.result()), "step": step, "restored": restored or 0})
            checkpoint.save(step)
        ctx.save_model(model)
''')

# A tf.keras (Keras 2) script shaped like TensorFlow's parameter-server tutorial (written here, not copied):
# string lookup layers built on the chief, an embedding split over both ps tasks, a step function of
# strategy.run + strategy.reduce scheduled through ClusterCoordinator with per-worker iterators and a join at
# each epoch's end, then Model.fit over a DatasetCreator on the same model. What a user of that tutorial
# changes is marked "raytf:": the strategy and the per-worker data come from ctx, epochs are reported.
TUTORIAL = textwrap.dedent('''
    import tensorflow as tf

    WORDS = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
    EPOCHS, STEPS = 4, 5


    def train(ctx):
        strategy = ctx.strategy  # raytf: instead of building ParameterServerStrategy from a cluster resolver

        with strategy.scope():
            to_ids = tf.keras.layers.StringLookup(vocabulary=WORDS, mask_token=None)
            words_in = tf.keras.layers.Input(shape=(3,), dtype=tf.string, name="features")
            preprocess = tf.keras.Model({"features": words_in}, to_ids(words_in))

        def worker_data(_):
            return ctx.dataset("train").map(  # raytf: this worker's shard, batched, shuffled, endless
                lambda x, y: ({"features": preprocess(x)}, tf.reshape(y, (-1, 1))))

        with strategy.scope():  # variables go to the ps tasks, the large one split over both
            ids_in = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
            embedding = tf.keras.layers.Embedding(input_dim=len(to_ids.get_vocabulary()), output_dim=16384)
            scores = tf.keras.layers.Dense(1, activation="sigmoid")(tf.reduce_mean(embedding(ids_in), axis=1))
            model = tf.keras.Model({"features": ids_in}, scores)
            optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.1)
            hits = tf.keras.metrics.Accuracy()

        shards = embedding.weights
        assert len(shards) == 2 and all(w.shape == (4, 16384) for w in shards)
        assert sorted(w.device for w in shards) == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(2)]

        @tf.function
        def step(iterator):
            def on_replica(features, labels):
                with tf.GradientTape() as tape:
                    predicted = model(features, training=True)
                    per_row = tf.keras.losses.BinaryCrossentropy(
                        reduction=tf.keras.losses.Reduction.NONE)(labels, predicted)
                    loss = tf.nn.compute_average_loss(per_row)
                optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                              model.trainable_variables))
                hits.update_state(labels, tf.cast(predicted > 0.5, tf.int64))
                return loss

            features, labels = next(iterator)
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(on_replica, args=(features, labels)),
                                   axis=None)

        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

        @tf.function
        def per_worker():
            return strategy.distribute_datasets_from_function(worker_data)

        iterator = iter(coordinator.create_per_worker_dataset(per_worker))
        for epoch in range(EPOCHS):
            hits.reset_states()
            for _ in range(STEPS):
                coordinator.schedule(step, args=(iterator,))
            coordinator.join()  # every scheduled step has run
            ctx.report({"accuracy": hits.result().numpy()})  # raytf: the epoch's metrics
        last = coordinator.schedule(step, args=(iterator,))
        assert last.fetch() >= 0

        with strategy.scope():  # the same model through Model.fit, as the tutorial's other path
            model.compile(tf.keras.optimizers.RMSprop(learning_rate=0.1), loss="binary_crossentropy",
                          metrics=["accuracy"])
        report = tf.keras.callbacks.LambdaCallback(  # raytf: fit's epochs into result.json
            on_epoch_end=lambda epoch, logs: ctx.report({f"fit_{k}": v for k, v in logs.items()}))
        model.fit(tf.keras.utils.experimental.DatasetCreator(worker_data), epochs=2, steps_per_epoch=STEPS,
                  callbacks=[report])
''')

# raytf's own loop over a dataset_fn: every worker makes the same rows (shuffled its own way), and with
# train.accumulation_steps 2 each scheduled step takes two of its batches.
DATASET_FN = textwrap.dedent('''
    import tensorflow as tf

    WORDS = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]

    def tags(input_context):
        rows = [[WORDS[(i * 3 + k * (1 + i % 5)) % 7] for k in range(3)] for i in range(700)]
        labels = [0 if "avenger" in r else 1 for r in rows]
        ds = tf.data.Dataset.from_tensor_slices((rows, labels)).shuffle(700).repeat()
        return ds.batch(input_context.get_per_replica_batch_size(32), drop_remainder=True)
''')


def tag_rows(n, seed):
    rng = random.Random(seed)
    features = [rng.sample(FEATURE_VOCAB, 3) for _ in range(n)]
    return {"features": pa.array(features, pa.list_(pa.string(), 3)),  # fixed-length list<string>
            "label": [0 if "avenger" in f else 1 for f in features]}  # label_vocab ["yes", "no"]: ids


def predict(model, rows):
    import tensorflow as tf

    return keras.ops.convert_to_numpy(model(tf.constant(rows), training=False))[:, 0]


@pytest.fixture(scope="module")
def ps_job_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ps-train-fn")
    (folder / "pstutorial.py").write_text(KERAS3_LOOP)
    (folder / "tftutorial.py").write_text(TUTORIAL)
    (folder / "psdataset.py").write_text(DATASET_FN)
    (folder / "tags").mkdir()
    pq.write_table(pa.table(tag_rows(TRAIN_ROWS, 1)), folder / "tags" / "train.parquet", row_group_size=200)
    pq.write_table(pa.table(tag_rows(VAL_ROWS, 2)), folder / "tags" / "val.parquet")
    return folder


def ps_spec(**changes):
    spec = base_spec(
        name="ps-train-fn", strategy="parameter_server", model="pstutorial:build_model", train_fn="pstutorial:train",
        data={"train": "tags/train.parquet", "validation": "tags/val.parquet", "features": ["features"],
              "label": "label", "preprocess": "pstutorial:lowercase"},
        loss="binary_crossentropy", metrics=["accuracy"],
        train={"epochs": 2, "global_batch_size": BATCH, "seed": 0, "shuffle_buffer": 256},
        cluster={"workers": 2, "ps": 1, "cpus_per_worker": 0.5, "cpus_per_ps": 0.25, "cpus_per_chief": 0.25,
                 "reserve_timeout_s": 30},
        checkpoint={"dir": "ckpt", "every_epochs": 1, "keep": 3},
        output={"tensorboard": False})
    for key, value in changes.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    return spec


@pytest.fixture(scope="module")
def first(cluster, ps_job_dir):
    """The Keras 3 ClusterCoordinator loop: 2 epochs, a checkpoint after each."""
    result = run(load(write_job(ps_job_dir, ps_spec())))
    assert_nothing_left()
    return result


@pytest.fixture(scope="module")
def resumed(first, ps_job_dir):
    """The same job with a third epoch, resumed from the first run's last checkpoint."""
    result = run(load(write_job(ps_job_dir, ps_spec(train={"epochs": 3}))), resume=True)
    assert_nothing_left()
    return result


@cluster_job(240)
def test_a_cluster_coordinator_loop_trains_on_the_chief_over_string_list_features(first, ps_job_dir):
    assert first.status == "succeeded"
    assert [t["role"] for t in first.tasks] == ["chief", "ps", "worker", "worker"]
    history = first.history
    assert [(h["epoch"], h["step"]) for h in history] == [(1, STEPS_PER_EPOCH), (2, 2 * STEPS_PER_EPOCH)]
    assert history[-1]["loss"] < history[0]["loss"], history  # the (batch, 3) string feature carries the signal
    assert history[-1]["val_accuracy"] > 0.9, history  # 0.57 say "no" to every row
    assert first.tasks[0]["steps"] == 2 * STEPS_PER_EPOCH
    model = keras.models.load_model(first.model_path)  # ctx.save_model: the chief's copy of the ps variables
    val = pq.read_table(ps_job_dir / "tags" / "val.parquet").to_pydict()
    saved_accuracy = np.mean((predict(model, val["features"]) > 0.5) == np.array(val["label"]))
    assert saved_accuracy == pytest.approx(history[-1]["val_accuracy"], abs=1e-6)  # the trained weights, saved


@cluster_job(60)
def test_its_checkpoints_are_in_checkpoint_dir(first, ps_job_dir):
    saved = sorted(p.name for p in (ps_job_dir / "ckpt").iterdir() if p.name.startswith("ckpt-"))
    assert saved == [f"ckpt-{STEPS_PER_EPOCH:012d}", f"ckpt-{2 * STEPS_PER_EPOCH:012d}"]
    last = ps_job_dir / "ckpt" / saved[-1]
    assert (last / "raytf.json").is_file() and any(p.name.startswith("state") for p in last.iterdir())


@cluster_job(240)
def test_a_resume_restores_the_step_and_the_weights(first, resumed):
    assert resumed.status == "succeeded"
    assert [h["epoch"] for h in resumed.history] == [1, 2, 3]
    assert resumed.history[:2] == first.history  # epochs 1-2 came back with the checkpoint
    assert resumed.history[2]["step"] == 3 * STEPS_PER_EPOCH and resumed.tasks[0]["steps"] == 3 * STEPS_PER_EPOCH
    assert resumed.history[2]["restored"] == 2 * STEPS_PER_EPOCH  # ckpt.restore() gave the step
    assert resumed.history[2]["loss"] < first.history[0]["loss"]  # the weights came back, not fresh ones


@cluster_job(240)
def test_a_tutorial_shaped_tf_keras_script_runs_its_coordinator_loop_and_fit(cluster, ps_job_dir):
    spec = ps_spec(name="tf-tutorial", model=None, train_fn="tftutorial:train", train={"keras": "legacy"},
                   cluster={"ps": 2}, checkpoint={"dir": None}, data={"preprocess": None})
    result = run(load(write_job(ps_job_dir, spec)))
    assert result.status == "succeeded"
    assert [t["role"] for t in result.tasks] == ["chief", "ps", "ps", "worker", "worker"]
    loop = [h for h in result.history if "accuracy" in h]
    fit = [h for h in result.history if "fit_loss" in h]
    assert len(loop) == 4 and len(fit) == 2, result.history
    assert loop[-1]["accuracy"] > 0.7, loop  # the embedding is split over both ps tasks (asserted in the loop)
    assert all(np.isfinite(h["fit_loss"]) for h in fit) and fit[-1]["fit_accuracy"] > 0.7, fit
    assert_nothing_left()


@cluster_job(240)
def test_a_dataset_fn_feeds_raytfs_loop(cluster, ps_job_dir):
    spec = ps_spec(name="ps-dataset-fn", model="pstutorial:build_model", train_fn=None, data=None,
                   dataset_fn="psdataset:tags", train={"steps_per_epoch": 12, "accumulation_steps": 2},
                   optimizer={"name": "adam", "learning_rate": 0.03},
                   checkpoint={"dir": None}, cluster={"workers": 1})  # the chief's schedule: one worker runs it
    result = run(load(write_job(ps_job_dir, spec)))
    assert result.status == "succeeded"
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 2 and losses[-1] < losses[0], losses
    assert [h["examples"] for h in result.history] == [12 * BATCH * 2] * 2  # 12 steps of 2 batches of 32
    assert result.tasks[0]["steps"] == 24
    model = keras.models.load_model(result.model_path)
    assert predict(model, [["avenger", "hulk", "batman"], ["ironman", "hulk", "batman"]]).shape == (2,)
    assert_nothing_left()


@pytest.mark.timeout(60)
def test_a_dataset_fn_gets_one_pipelines_context_or_nothing_and_is_micro_batched_batch_major():
    """How raytf's parameter-server loop calls a dataset_fn on a worker (no cluster needed)."""
    import tensorflow as tf

    from raytf.actor.parameter_server import user_batches

    def rows():
        return tf.data.Dataset.range(64).map(lambda i: (tf.fill([3], i), i))

    seen = []

    def with_context(input_context):  # as under mirrored
        seen.append((input_context.num_input_pipelines, input_context.input_pipeline_id,
                     input_context.get_per_replica_batch_size(32)))
        return rows().batch(4)

    x, y = next(iter(user_batches(with_context, micro_batches=1)))
    assert seen == [(1, 0, 32)] and x.shape == (4, 3)  # one step's batch: the whole global batch
    x, y = next(iter(user_batches(lambda: rows().batch(4), micro_batches=2)))  # create_per_worker_dataset's style
    assert x.shape == (4, 2, 3) and y.numpy().tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]  # micro-batch k: [:, k]
