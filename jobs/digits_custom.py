"""A custom training loop in the tf.distribute tutorials' style, run by raytf (jobs/digits-custom.yaml):
strategy.run + strategy.reduce over a distributed dataset, global batch = per-replica batch x replicas.

raytf hands it a ctx: the strategy (MultiWorkerMirroredStrategy over every worker), this worker's shard of
the job's Parquet data, checkpoints that a restart or --resume restores, and report() for each epoch.
"""
import keras
import tensorflow as tf


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(128),
        keras.layers.BatchNormalization(),
        keras.layers.Activation("relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(10),
    ])


def correct(y, logits):
    return tf.cast(tf.equal(tf.argmax(logits, -1), tf.cast(y, tf.int64)), tf.float32)


def train(ctx):
    strategy = ctx.strategy
    epochs = ctx.spec.train.epochs
    with strategy.scope():
        model = ctx.build_model()
        optimizer = keras.optimizers.Adam(0.003)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    checkpoint = ctx.checkpoint(model=model, optimizer=optimizer)
    step = checkpoint.restore() or 0  # after a restart, or with --resume: the step it continues from

    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            # each replica's loss over the GLOBAL batch: the all-reduced gradients are then the batch mean
            loss = tf.nn.compute_average_loss(loss_fn(y, logits), global_batch_size=ctx.global_batch_size)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return tf.stack([loss, tf.reduce_sum(correct(y, logits))])

    @tf.function
    def distributed_train_step(batch):
        per_replica = strategy.run(train_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)  # [loss, correct] of the step

    def test_step(x, y, weight):  # weight 0: padding rows that even out the workers' batches
        logits = model(x, training=False)
        return tf.stack([tf.reduce_sum(correct(y, logits) * weight), tf.reduce_sum(weight)])

    @tf.function
    def distributed_test_step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(test_step, args=batch), axis=None)

    for epoch in range(step // ctx.steps_per_epoch + 1, epochs + 1):
        done = step % ctx.steps_per_epoch  # steps of this epoch trained before a restart
        total_loss = right = 0.0
        batches = 0
        for batch in ctx.distributed_dataset("train", epoch=epoch, skip=done):
            loss, c = distributed_train_step(batch).numpy()
            total_loss, right, batches = total_loss + loss, right + c, batches + 1
            step += 1
            ctx.step(step, loss=total_loss / batches)
            if step % 10 == 0 and step % ctx.steps_per_epoch:  # mid-epoch; an epoch's end saves after its report
                checkpoint.save(step)
        hits = total = 0.0
        for batch in ctx.distributed_dataset("validation"):
            h, n = distributed_test_step(batch).numpy()
            hits, total = hits + h, total + n
        # over every worker's rows (strategy.reduce); a resumed epoch's over the steps since the restart
        ctx.report({"loss": total_loss / batches, "accuracy": right / (batches * ctx.global_batch_size),
                    "val_accuracy": hits / total, "step": step})
        checkpoint.save(step)
    ctx.save_model(model)  # on every worker: syncs BatchNormalization statistics; the chief's is written
