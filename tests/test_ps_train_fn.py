"""Parameter servers run the user's code: a train_fn on the chief (ctx.strategy the ParameterServerStrategy,
ctx.coordinator its ClusterCoordinator) in the style of TensorFlow's parameter-server tutorial, with
checkpoints, the job's data and a fixed-length list<string> feature; TensorFlow's tutorial itself under
tf.keras (train.keras: legacy), its model.fit included; and a dataset_fn under raytf's loop."""
import random
import textwrap

import keras
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytf.driver.controller import run
from raytf.spec import load
from tests.conftest import assert_nothing_left, base_spec, write_job

# TF 2.21's ClusterCoordinator can segfault the chief while workers run their first steps (see
# tests/test_parameter_server.py): a job whose chief died that way runs once more.
CHIEF_CRASHED = r"TrainingFailed: training failed: chief 0 \(rank 0, [^)]*\): rank\(s\) 0: actor died"



def cluster_job(timeout_s):
    """A test that runs real jobs on the session's Ray cluster (and may run once more after that crash)."""
    def mark(test):
        for m in (pytest.mark.cluster, pytest.mark.timeout(timeout_s),
                  pytest.mark.flaky(reruns=1, only_rerun=[CHIEF_CRASHED])):
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

# TensorFlow's parameter-server tutorial (tensorflow/docs, site/en/tutorials/distribute/
# parameter_server_training.ipynb), custom training loop section as written, tf.keras (Keras 2), then its
# Model.fit path on the same model. Changed: where the strategy comes from (ctx, not a cluster resolver)
# and the data (ctx.dataset, not from_tensor_slices of generated examples; its label is already an id).
# Added: ctx.report lines, so result.json has what it printed.
TUTORIAL = textwrap.dedent('''
    import tensorflow as tf

    feature_vocab = [
        "avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"
    ]
    label_vocab = ["yes", "no"]

    def train(ctx):
        strategy = ctx.strategy  # changed: was ParameterServerStrategy(cluster_resolver, variable_partitioner=...)

        with strategy.scope():
          feature_lookup_layer = tf.keras.layers.StringLookup(
              vocabulary=feature_vocab,
              mask_token=None)
          label_lookup_layer = tf.keras.layers.StringLookup(
              vocabulary=label_vocab,
              num_oov_indices=0,
              mask_token=None)

          raw_feature_input = tf.keras.layers.Input(
              shape=(3,),
              dtype=tf.string,
              name="feature")
          feature_id_input = feature_lookup_layer(raw_feature_input)
          feature_preprocess_stage = tf.keras.Model(
              {"features": raw_feature_input},
              feature_id_input)

          raw_label_input = tf.keras.layers.Input(
              shape=(1,),
              dtype=tf.string,
              name="label")
          label_id_input = label_lookup_layer(raw_label_input)

          label_preprocess_stage = tf.keras.Model(
              {"label": raw_label_input},
              label_id_input)

        def dataset_fn(_):
          raw_dataset = ctx.dataset("train")  # changed: this worker's shard, shuffled, batched, endless

          train_dataset = raw_dataset.map(
              lambda x, y: (  # changed: (features, label id) batches
                  {"features": feature_preprocess_stage(x)},
                  tf.reshape(y, (-1, 1))
              ))
          return train_dataset

        # These variables created under the `Strategy.scope` will be placed on parameter
        # servers in a round-robin fashion.
        with strategy.scope():
          # Create the model. The input needs to be compatible with Keras processing layers.
          model_input = tf.keras.layers.Input(
              shape=(3,), dtype=tf.int64, name="model_input")

          emb_layer = tf.keras.layers.Embedding(
              input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
          emb_output = tf.reduce_mean(emb_layer(model_input), axis=1)
          dense_output = tf.keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
          model = tf.keras.Model({"features": model_input}, dense_output)

          optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.1)
          accuracy = tf.keras.metrics.Accuracy()

        assert len(emb_layer.weights) == 2
        assert emb_layer.weights[0].shape == (4, 16384)
        assert emb_layer.weights[1].shape == (4, 16384)
        assert emb_layer.weights[0].device == "/job:ps/replica:0/task:0/device:CPU:0"
        assert emb_layer.weights[1].device == "/job:ps/replica:0/task:1/device:CPU:0"

        @tf.function
        def step_fn(iterator):

          def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
              pred = model(batch_data, training=True)
              per_example_loss = tf.keras.losses.BinaryCrossentropy(
                      reduction=tf.keras.losses.Reduction.NONE)(labels, pred)
              loss = tf.nn.compute_average_loss(per_example_loss)
              gradients = tape.gradient(loss, model.trainable_variables)

            optimizer.apply_gradients(zip(gradients, model.trainable_variables))

            actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
            accuracy.update_state(labels, actual_pred)
            return loss

          batch_data, labels = next(iterator)
          losses = strategy.run(replica_fn, args=(batch_data, labels))
          return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

        @tf.function
        def per_worker_dataset_fn():
          return strategy.distribute_datasets_from_function(dataset_fn)

        per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
        per_worker_iterator = iter(per_worker_dataset)

        num_epoches = 4
        steps_per_epoch = 5
        for i in range(num_epoches):
          accuracy.reset_states()
          for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
          # Wait at epoch boundaries.
          coordinator.join()
          print ("Finished epoch %d, accuracy is %f." % (i, accuracy.result().numpy()))
          ctx.report({"accuracy": accuracy.result().numpy()})  # added

        loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
        print ("Final loss is %f" % loss.fetch())

        # The tutorial's Model.fit path, on this model and data
        with strategy.scope():
          model.compile(tf.keras.optimizers.RMSprop(learning_rate=0.1), loss="binary_crossentropy",
                        metrics=["accuracy"])
        report = tf.keras.callbacks.LambdaCallback(  # added
            on_epoch_end=lambda epoch, logs: ctx.report({f"fit_{k}": v for k, v in logs.items()}))
        dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
        model.fit(dc, epochs=2, steps_per_epoch=5, callbacks=[report])
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
def test_tensorflows_tutorial_runs_under_tf_keras_loop_and_fit(cluster, ps_job_dir):
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
                   checkpoint={"dir": None})
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
