"""The model and preprocessing of jobs/shapes.yaml: a small ResNet-style CNN over 32x32 pictures of four
shapes, stored as PNG bytes in Parquet and decoded by raytf (data.decode)."""
import keras
import tensorflow as tf

SIZE = 32


def preprocess(example, training, seed):
    """One example, inside tf.data on every worker: pixels to 0..1 and, for training, a random crop of the
    picture padded by 4 pixels and a random left-right flip. Stateless ops with raytf's per-example seed,
    so the augmentation is the same run after run."""
    image = tf.cast(example["image"], tf.float32) / 255.0
    if training:
        crop, flip = tf.unstack(tf.random.experimental.stateless_split(seed, 2))  # one seed per random op
        image = tf.image.resize_with_crop_or_pad(image, SIZE + 8, SIZE + 8)
        image = tf.image.stateless_random_crop(image, [SIZE, SIZE, 3], seed=crop)
        image = tf.image.stateless_random_flip_left_right(image, seed=flip)
    return {"image": tf.ensure_shape(image, [SIZE, SIZE, 3]), "label": example["label"]}


def residual(x, filters: int, stride: int):
    shortcut = x
    x = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
        shortcut = keras.layers.BatchNormalization(momentum=0.9)(shortcut)
    return keras.layers.ReLU()(x + shortcut)


def build_model() -> keras.Model:
    inputs = keras.Input(shape=(SIZE, SIZE, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = residual(x, 16, 1)
    x = residual(x, 32, 2)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(4, dtype="float32")(x)  # float32 logits under mixed precision too
    return keras.Model(inputs, outputs)
