"""The model of jobs/digits.yaml: a small MLP over 8x8 handwritten digits (64 pixels in 0..1)."""
import keras


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
