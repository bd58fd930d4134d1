"""What a job leaves for serving, written by the chief into its staging folder (shipped to output.dir):
`model.keras`, and with output.export: [saved_model] a TensorFlow SavedModel for TF Serving whose
`serving_default` signature takes the job's feature columns by name (dtypes and shapes from the Parquet
schema) and returns `{"output": the model's output, float32}`.

The SavedModel is written from a plain copy of the model, built outside any strategy with the trained
weights: no MirroredVariables, no ps shards (a partitioned table is one variable again), and a subclassed
model works as well as a functional one.

It is written with `keras.export.ExportArchive`, which saves the variables the signature reads as the
SavedModel's own (Keras 3 models, and tf.keras ones under train.keras: legacy). A Keras 3 model as an
attribute of a `tf.Module` (`tf.saved_model.save`) loads with `tf.saved_model.load`, but the TF1 session
loader that TF Serving and `saved_model_cli run` use fails on the first prediction ("Could not find
variable ..."; tensorflow#72963, keras#20095).
"""
from __future__ import annotations

import os
from typing import Callable

import keras
import tensorflow as tf

from raytf.actor import steps as steps_lib
from raytf.actor.examples import Examples
from raytf.actor.inputs import input_specs, model_input, sample_input
from raytf.data import Column

SAVED_MODEL_DIR = "saved_model"
KERAS_FILE = "model.keras"


def write(model: keras.Model, payload, staging_dir: str, plain: bool = False) -> dict[str, str]:
    """Every format in output.export; returns {format: path relative to the staging folder}. `plain`:
    `model` is already built outside any strategy (the parameter-server chief's copy), so the SavedModel
    is written from it instead of from a new copy."""
    formats = payload.spec.output.export
    out: dict[str, str] = {}
    if "keras" in formats:
        model.save(os.path.join(staging_dir, KERAS_FILE))
        out["keras"] = KERAS_FILE
    if "saved_model" in formats:
        features = payload.train_data.features if payload.train_data is not None else None
        if features is None:
            raise ValueError("output.export: saved_model needs data (Parquet): the signature is named after "
                             "its feature columns")
        servable = model if plain else plain_copy(builder(model, payload), model.get_weights(), payload)
        saved_model(servable, features, os.path.join(staging_dir, SAVED_MODEL_DIR), payload)
        out["saved_model"] = SAVED_MODEL_DIR
    return out


_LIBRARY_MODULES = ("keras", "tf_keras", "tensorflow", "builtins", "numpy")


def load_note(staging_dir: str, legacy: bool = False) -> str | None:
    """Load model.keras as a user would, and say in one line what that takes when it is more than
    `load_model(path)`: the modules that register its classes, safe_mode=False for Python code in it, or
    that it cannot be loaded as written and why. None when a plain load_model works."""
    import json
    import zipfile

    path = os.path.join(staging_dir, KERAS_FILE)
    if not os.path.isfile(path):
        return None
    if legacy:  # tf-keras under train.keras: legacy
        from tf_keras.models import load_model as load
    else:
        load = keras.saving.load_model
    try:
        load(path)
    except Exception as exc:  # noqa: BLE001 -- whatever the loader says is what a user would meet
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if "safe_mode" in str(exc):
            try:
                load(path, safe_mode=False)
                return (f"model.keras loads only with load_model(path, safe_mode=False): it holds Python code "
                        f"(a lambda or a plain function); trust the file before loading it that way")
            except Exception:  # noqa: BLE001 -- not even then: said below
                pass
        return (f"model.keras does not load as written ({type(exc).__name__}: {first}); give the model's own "
                f"classes get_config() (and from_config), or register them with "
                f"@keras.saving.register_keras_serializable()")
    try:  # Keras 3's .keras is a zip with config.json; tf-keras may have written another format under the name
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, ValueError):
        return None
    modules = sorted(_custom_modules(config))
    if modules:
        return (f"model.keras loads with load_model(path) once {', '.join(f'`import {m}`' for m in modules)} "
                f"has run (it registers the model's own classes)")
    return None


def _custom_modules(config) -> set[str]:
    """The modules of the classes in a Keras config that are not Keras's own (a user's layers, models)."""
    found = set()
    if isinstance(config, dict):
        module = config.get("module")
        if isinstance(module, str) and "class_name" in config and not module.startswith(_LIBRARY_MODULES):
            found.add(module)
        for value in config.values():
            found |= _custom_modules(value)
    elif isinstance(config, list):
        for value in config:
            found |= _custom_modules(value)
    return found


def builder(model, payload) -> Callable[[], keras.Model]:
    """What builds a fresh copy of `model`: the spec's model function, or (a train_fn that builds its own
    model, no `model:` in the spec) a clone from the model's config, Keras 3 or tf.keras as the model is."""
    if payload.spec.model is not None:
        return payload.function("model")
    if isinstance(model, keras.Model):
        clone_model = keras.models.clone_model
    else:  # a tf.keras (tf-keras, Keras 2) model
        from tf_keras.models import clone_model

    def clone() -> keras.Model:
        try:
            return clone_model(model)
        except Exception as exc:
            raise ValueError(f"output.export: saved_model: could not copy the train_fn's {type(model).__name__} "
                             f"from its config ({type(exc).__name__}: {exc}); name the function that builds it "
                             f"as the spec's model: (module:function)") from exc

    return clone


def plain_copy(build: Callable[[], keras.Model], weights: list, payload) -> keras.Model:
    """A fresh model with `weights`, outside any strategy; called once on one row first, so a subclassed
    model has its variables."""
    model = build()
    model(sample_input(payload), training=False)
    model.set_weights(weights)
    return model


def saved_model(model: keras.Model, features: tuple[Column, ...], path: str, payload=None) -> None:
    """The model behind a `serving_default` signature over the raw feature columns, by name. With
    data.decode/preprocess, those run inside it, per row, as for validation: clients send what the Parquet
    holds (e.g. PNG bytes)."""
    examples = None
    if payload is not None and payload.spec.data.per_example:
        examples, example_input = Examples(payload, payload.train_data, training=False), sample_input(payload)

    @tf.function(input_signature=[input_specs(features)])
    def serve(inputs):
        x = examples.serving_input(inputs, example_input) if examples is not None else model_input(features, inputs)
        output = steps_lib.float32(model(x, training=False))
        return output if isinstance(output, dict) else {"output": output}

    archive = keras.export.ExportArchive()
    archive.track(model)  # its variables, and any lookup table in it
    archive.add_endpoint("serving_default", serve)  # a traced tf.function: autograph on, as for training
    archive.write_out(path, verbose=False)
