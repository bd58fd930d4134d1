"""The per-example path of raytf's input pipeline (data.decode, data.preprocess, data.cache), inside tf.data.

Rows leave the Parquet reader as chunks of columns; here they become one example each, a dict of tensors
by column name (label included): image columns decoded to uint8 [height, width, channels], then the
user's preprocess function (TF ops only: it runs as a graph on every worker, parameter-server workers
included), then (x, y[, weight]) for the model: x is every key but the label (one key: that tensor).
Maps run with num_parallel_calls=AUTOTUNE and keep their order; a preprocess function that takes `seed`
gets one per example ([2] int64, mixed from train.seed, the worker and the example's place in its stream), for
tf.image.stateless_random_* augmentation that is the same run after run.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import tensorflow as tf

from raytf.data import DatasetInfo
from raytf.spec import function_ref

AUTOTUNE = tf.data.AUTOTUNE
DECODERS = {"jpeg": tf.io.decode_jpeg, "png": tf.io.decode_png}


class PreprocessError(ValueError):
    """data.preprocess cannot run inside tf.data: said before the first step, naming the function."""


class Examples:
    """One split's per-example maps (training: augmentation on; validation: off)."""

    def __init__(self, payload, info: DatasetInfo, training: bool, cache_dir: str | None = None):
        """cache_dir: where data.cache: disk writes (None: names are relative to the working directory)."""
        spec = payload.spec
        self.info, self.training = info, training
        self.names = [c.name for c in (*info.features, info.label)]
        self.label = info.label.name
        self.decode = {d.column: d for d in spec.data.decode}
        self.cache = spec.data.cache
        key = "data.preprocess_validation" if not training and spec.data.preprocess_validation else "data.preprocess"
        self.ref = function_ref(spec, key)
        self.fn: Callable | None = payload.function(key) if self.ref else None
        self.takes = _parameters(self.fn) if self.fn is not None else set()
        self.cache_dir = cache_dir

    # ---------------------------------------------------------------- the maps
    def decoded(self, rows: tf.data.Dataset, weighted: bool) -> tf.data.Dataset:
        """Rows (column tuples[, weight]) -> (example dict[, weight]), image columns decoded."""
        return rows.map(self._to_example(weighted), num_parallel_calls=AUTOTUNE, deterministic=True)

    def _to_example(self, weighted: bool) -> Callable:
        names, decode = self.names, self.decode

        def to_example(*columns):
            example = {}
            for name, value in zip(names, columns):
                if name in decode:
                    d = decode[name]
                    value = DECODERS[d.format](value, channels=d.channels)
                example[name] = value
            return (example, columns[len(names)]) if weighted else example

        return to_example

    def cached(self, examples: tf.data.Dataset, name: str) -> tf.data.Dataset:
        """data.cache: in memory, or in files named `name` (under cache_dir) on the local disk."""
        if self.cache == "none":
            return examples
        if self.cache == "memory":
            return examples.cache()
        if self.cache_dir is not None:
            os.makedirs(self.cache_dir, exist_ok=True)
            name = os.path.join(self.cache_dir, name)
        return examples.cache(name)

    def prepared(self, examples: tf.data.Dataset, seed: int, worker: Any, weighted: bool,
                 decode: bool = False, first_index: int = 0) -> tf.data.Dataset:
        """(example[, weight]) -> (x, y[, weight]) through the preprocess function. `decode`: the elements
        are still rows (column tuples[, weight]), decoded in the same map (one map is cheaper than two:
        measured in benchmarks/bench_images.py). `first_index`: the first example's place in the stream (a
        resumed run's), which its preprocess seed is made from."""
        prepare, wrong = self._prepare_fn(seed, worker, weighted, decode)
        try:
            return examples.enumerate(first_index).map(prepare, num_parallel_calls=AUTOTUNE, deterministic=True)
        except Exception as exc:  # tracing it failed: Python or NumPy work on symbolic tensors
            raise self._traced_wrong(exc, wrong) from None

    def _prepare_fn(self, seed: int, worker: Any, weighted: bool, decode: bool) -> tuple[Callable, list[str]]:
        """The per-example function (index, element) -> (x, y[, weight]), and where it notes what was wrong
        with the preprocess function's output (autograph re-raises errors as its own)."""
        fn, takes, label, training, ref = self.fn, self.takes, self.label, self.training, self.ref
        to_example = self._to_example(weighted) if decode else None
        stream = tf.stack([tf.cast(seed, tf.int64), tf.cast(worker, tf.int64)])
        wrong: list[str] = []

        def prepare(index, element):
            if to_example is not None:
                element = to_example(*element)
            example, weight = element if weighted else (element, None)
            if fn is not None:
                kwargs = {}
                if "training" in takes:
                    kwargs["training"] = training
                if "seed" in takes:
                    # mixed, not added: a user's `seed + 1` is not another example's (or worker's) seed
                    kwargs["seed"] = tf.random.experimental.stateless_fold_in(stream, index)
                example = fn(dict(example), **kwargs)
                if not isinstance(example, dict) or label not in example:
                    wrong.append(f"data.preprocess {ref} returned {type(example).__name__}"
                                 + (f" without the label {label!r}" if isinstance(example, dict) else "")
                                 + f"; it must return the example dict, the label {label!r} in it")
                    raise PreprocessError(wrong[-1])
            x = {k: v for k, v in example.items() if k != label}
            x = next(iter(x.values())) if len(x) == 1 else x
            return (x, example[label], weight) if weighted else (x, example[label])

        return prepare, wrong

    def _traced_wrong(self, exc: Exception, wrong: list[str]) -> PreprocessError:
        if wrong:
            return PreprocessError(wrong[-1])
        return PreprocessError(
            f"data.preprocess {self.ref} cannot run inside tf.data ({_root_cause(exc)}); it runs as a "
            f"TensorFlow graph on every worker, so use TensorFlow ops only (tf.image, tf.io, tf.cast; no "
            f".numpy(), NumPy or PIL on its tensors)")

    # ---------------------------------------------------------------- for building and serving the model
    def model_input(self, rows: tuple) -> Any:
        """The model's input for `rows` (column arrays, as the reader yields them): decoded and preprocessed
        like validation rows, batched. Builds a subclassed model, or a serving copy."""
        ds = tf.data.Dataset.from_tensor_slices(tuple(rows))
        x, _ = next(iter(self.prepared(ds, 0, 0, weighted=False, decode=True).batch(len(rows[0]))))
        return x

    def serving_input(self, inputs: dict[str, tf.Tensor], example_input: Any) -> Any:
        """Inside a SavedModel's signature: a batch of raw feature columns (no label) -> the model's input,
        each row decoded and preprocessed as a validation row (training=False, one fixed seed).
        `example_input`: a batch of the model's input, for its per-row structure."""
        prepare, _ = self._prepare_fn(0, 0, weighted=False, decode=True)
        label_dtype = tf.as_dtype(self.info.label.tf_dtype)

        def one(row: dict[str, tf.Tensor]):
            columns = tuple(row[name] if name != self.label else tf.zeros(self.info.label.shape, label_dtype)
                            for name in self.names)
            return prepare(tf.constant(0, tf.int64), columns)[0]

        signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), example_input)
        return tf.map_fn(one, inputs, fn_output_signature=signature)


def _parameters(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _root_cause(exc: Exception) -> str:
    """'Type: message' of what went wrong in the user's function: autograph wraps it in a StagingError whose
    last line is the original error."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if type(exc).__name__ == "StagingError" and ":" in last:
        return last[:300]
    return f"{type(exc).__name__}: {last[:300]}"
