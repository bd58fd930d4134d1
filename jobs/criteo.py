"""A wide-and-deep click-through model for the Criteo-shaped data (raytf.synthetic.criteo_like):
13 dense counts I1..I13 and 26 hashed categorical strings C1..C26 -> click probability (a logit).

Every categorical column hashes into its own range of one shared embedding table, so the table is one
large variable (26 x 4,096 rows): the variable partitioner splits it over the ps tasks, and
raytf.layers.Embedding looks rows up on the ps task that holds them.
"""
import keras
from keras import layers

import raytf.layers

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
BUCKETS = 4096  # hash buckets per categorical column
DIM = 4


def build_model() -> keras.Model:
    inputs = {name: keras.Input(shape=(), name=name, dtype="int64") for name in DENSE}
    inputs.update({name: keras.Input(shape=(), name=name, dtype="string") for name in CATEGORICAL})

    # Column j's ids land in [j * BUCKETS, (j + 1) * BUCKETS) of the shared tables.
    ids = layers.Concatenate()([
        layers.Reshape((1,))(layers.Hashing(num_bins=BUCKETS, salt=j)(inputs[name]) + j * BUCKETS)
        for j, name in enumerate(CATEGORICAL)])
    rows = BUCKETS * len(CATEGORICAL)
    wide = layers.Flatten()(raytf.layers.Embedding(rows, 1, name="wide_weights")(ids))
    deep_embeddings = layers.Flatten()(raytf.layers.Embedding(rows, DIM, name="deep_embeddings")(ids))

    counts = layers.Concatenate()([layers.Reshape((1,))(inputs[name]) for name in DENSE])
    dense = keras.ops.log1p(keras.ops.maximum(keras.ops.cast(counts, "float32"), 0.0))
    deep = layers.Concatenate()([deep_embeddings, dense])
    for width in (128, 64):
        deep = layers.Dense(width, activation="relu")(deep)
    logit = layers.Add()([layers.Dense(1)(deep), keras.ops.sum(wide, axis=1, keepdims=True)])
    return keras.Model(inputs, logit, name="wide_and_deep")
