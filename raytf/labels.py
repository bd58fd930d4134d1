"""A label's shape against the loss and the model's output: one line naming both before any actor starts
(from the Parquet metadata), or at the first step when a preprocess may reshape it. Pure: no TensorFlow.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from raytf.errors import SpecError
from raytf.spec import JobSpec

SPARSE_LOSSES = {"sparse_categorical_crossentropy"}  # a class id per row (per position); output: + a classes axis
ONE_HOT_LOSSES = {"categorical_crossentropy", "categorical_focal_crossentropy", "categorical_hinge"}
# Keras losses whose label has the output's shape (per row; a scalar label matches an output of width 1)
SAME_SHAPE_LOSSES = ONE_HOT_LOSSES | {
    "mean_squared_error", "mse", "mean_absolute_error", "mae", "mean_absolute_percentage_error", "mape",
    "mean_squared_logarithmic_error", "msle", "huber", "log_cosh", "logcosh", "binary_crossentropy",
    "binary_focal_crossentropy", "kl_divergence", "kld", "kullback_leibler_divergence", "poisson", "hinge",
    "squared_hinge", "cosine_similarity"}


class LabelShapeError(SpecError):
    """A label the loss (or the model's output) cannot take. Raised inside a traced step too, where AutoGraph
    would rewrap it (as a StagingError, "in user code:" and a stack); `ag_pass_through` keeps the one line."""

    ag_pass_through = True


def loss_key(name: str) -> str:
    """A Keras loss name as snake case: CategoricalCrossentropy and categorical_crossentropy are one loss."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def describe_label(shape: tuple) -> str:
    shape = tuple(shape)
    if not shape:
        return "one number per row"
    if len(shape) == 1:
        return f"a vector of {shape[0]} numbers per row"
    return f"a tensor {list(shape)} per row"


def check_label_shape(loss: str, label: str | None, label_shape: tuple, output_shape: tuple | None = None,
                      values: str = "") -> None:
    """A label's per-row shape against the loss (and, when known, the model's per-row output shape);
    SpecError naming the label's shape and the loss that fits. `values`: "integer" | "float" | "" (unknown),
    the kind of numbers stored: a vector of floats with the sparse loss is taken for one-hot without the model.
    Unknown dimensions (None) are not checked."""
    key, name = loss_key(loss), f"label {label!r}" if label else "the label"
    label_shape = tuple(label_shape)
    words = describe_label(label_shape)
    if key in ONE_HOT_LOSSES and not label_shape:
        raise LabelShapeError(f"loss: {loss} takes one-hot label vectors, but {name} is {words} (a class id?); "
                              f"use loss: sparse_categorical_crossentropy, or write the label one-hot as a "
                              f"fixed-size list (keras.utils.to_categorical)")
    if output_shape is not None:
        output_shape = tuple(output_shape)
        if None in label_shape or None in output_shape:
            return
        if key in SAME_SHAPE_LOSSES and label_shape == output_shape[:-1] and output_shape[-1:] == (1,):
            label_shape = output_shape  # (batch,) against (batch, 1): raytf gives the label the output's rank
    if key in SPARSE_LOSSES and label_shape and (
            (output_shape == label_shape and label_shape[-1] != 1)
            or (output_shape is None and len(label_shape) == 1 and values == "float")):
        raise LabelShapeError(f"loss: {loss} takes one class id per row, but {name} is {words} (one-hot?); use "
                              f"loss: categorical_crossentropy (or write the class id, the vector's argmax)")
    if output_shape is None:
        return
    if key in SPARSE_LOSSES and label_shape not in (output_shape[:-1], output_shape[:-1] + (1,)):
        raise LabelShapeError(f"loss: {loss} needs the model's output to be the label's shape plus a last axis of "
                              f"classes, but {name} is {words} and the model outputs {describe_label(output_shape)}")
    if key in SAME_SHAPE_LOSSES and label_shape != output_shape:
        wide = f"; make the model's last layer {label_shape[0]} wide" if len(label_shape) == 1 else ""
        raise LabelShapeError(f"loss: {loss} needs a label of the model's output shape, but {name} is {words} and "
                              f"the model outputs {describe_label(output_shape)}{wide} (or fix the label)")


def check_labels(spec: JobSpec, datasets: Mapping[str, Any], output_shape: tuple | None = None) -> None:
    """At load, from the Parquet metadata: the label's shape against the loss (raytf's loop; a preprocess
    may reshape the label, then the check waits for the first step), and validation's label like train's.
    `output_shape`: the model's per-row output shape (model.output_shape[1:]), when the driver built it."""
    train, validation = datasets.get("train"), datasets.get("validation")
    if train is None or spec.train_fn is not None:
        return
    label = train.label
    if validation is not None and validation.label.shape != label.shape:
        raise SpecError(f"data.validation: label {label.name!r} is {describe_label(validation.label.shape)}, but "
                        f"{describe_label(label.shape)} in data.train; write both with one shape")
    if spec.data.preprocess is None and spec.data.preprocess_validation is None:
        check_label_shape(spec.loss.name, label.name, label.shape, output_shape, values=label.values)
