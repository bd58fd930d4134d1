"""Keras layers for parameter-server jobs (importing this module imports TensorFlow)."""
from __future__ import annotations

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="raytf")
class Embedding(keras.layers.Embedding):
    """keras.layers.Embedding that looks rows up where they live. Keras's own layer first turns a table
    partitioned over ps tasks into one tensor, so all of it crosses the network on every step;
    tf.nn.embedding_lookup gathers from each shard on its own ps task, so only the rows asked for move.
    Same weights and config as keras.layers.Embedding; anywhere else it behaves the same."""

    def call(self, inputs):
        ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int64)
        return tf.cast(tf.nn.embedding_lookup(self.embeddings.value, ids), self.compute_dtype)
