"""An existing tf.keras (Keras 2) script, run by raytf unchanged but for where it gets its strategy and data
(jobs/digits-legacy.yaml: train.keras: legacy runs it under tf-keras, TF_USE_LEGACY_KERAS=1).

Keras 2's model.fit works under MultiWorkerMirroredStrategy; Keras 3's does not on TensorFlow 2.21.
"""
import tensorflow as tf


def build_model():
    return tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.2),
        tf.keras.layers.Dense(10),
    ])


def train(ctx):
    with ctx.strategy.scope():
        model = ctx.build_model()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.003),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(ctx.distributed_dataset("train"), epochs=ctx.spec.train.epochs,
                        steps_per_epoch=ctx.steps_per_epoch, verbose=0,
                        callbacks=[tf.keras.callbacks.LambdaCallback(
                            on_epoch_end=lambda epoch, logs: ctx.report(logs))])
    ctx.save_model(model)
    return history
