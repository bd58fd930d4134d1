"""Build the job's model once in the driver, before anything starts: a model function that cannot build
(a shape error, a typo in a layer's arguments) is one line naming the user's file and line in seconds,
instead of after reservation, actor start and TensorFlow's start-up in every worker (~30 s).

Only for raytf's loop under Keras 3 (a train_fn builds its own model; tf-keras is not this process's Keras).
The driver has imported Keras already for the loss, optimizer and metric names. It builds the model as rank
0 would (TF_CONFIG of the chief), with the job folder as the working directory and its output held back.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import traceback
from pathlib import Path

from raytf import backends
from raytf.errors import SpecError, clip

# (job folder, model ref) -> its output shape, for the models built fine in this process: a sweep builds once
_built: dict[tuple[str, str], tuple | None] = {}


def _rank_zero_tf_config(spec) -> str:
    return json.dumps(backends.get(spec.strategy).rank_zero_tf_config(spec))


def model_output_shape(spec, job_dir: Path, build) -> tuple | None:
    """Call the model function `build` as rank 0 would, with the job folder as the working directory (as in
    the actors); SpecError naming file:line and the exception if it raises or returns no Keras model. Returns
    the model's per-row output shape where it has one output of known shape (else None: checked later)."""
    from raytf.actor import raised

    job_dir = Path(job_dir)
    if spec.train_fn is not None or spec.train.keras == "legacy" or spec.model is None:
        return None
    key = (str(job_dir), spec.model)
    if key in _built:
        return _built[key]
    import keras

    here, tf_config = os.getcwd(), os.environ.get("TF_CONFIG")
    try:
        os.chdir(job_dir)
        os.environ["TF_CONFIG"] = tf_config or _rank_zero_tf_config(spec)  # a model may ask who it is
        with contextlib.redirect_stdout(io.StringIO()):  # model.summary() and the like: the workers' logs have them
            model = build()
    except Exception as exc:
        frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
        where = raised.user_line(frames, str(exc), [str(job_dir)])
        raise SpecError(f"model: {spec.model} cannot be built: " + (f"{where}: " if where else "")
                        + f"{type(exc).__name__}: {clip(raised.summary(str(exc)))}") from None
    finally:
        os.chdir(here)
        if tf_config is None:
            os.environ.pop("TF_CONFIG", None)
    if not isinstance(model, keras.Model):
        raise SpecError(f"model: {spec.model} returned {clip(repr(model), 100)}, not a Keras model; return e.g. "
                        f"keras.Sequential([...])")
    if "keras" in spec.output.export:  # found now, not after every epoch has trained (the save comes last)
        try:
            keras.saving.serialize_keras_object(model)
        except (NotImplementedError, TypeError, ValueError) as exc:
            raise SpecError(f"output.export: keras: the model from {spec.model} cannot be saved as model.keras "
                            f"({type(exc).__name__}: {clip(raised.summary(str(exc)))}); give "
                            f"{type(model).__name__} a get_config() returning its __init__ arguments, or export only "
                            f"a SavedModel (output.export: [saved_model])") from None
    try:
        output = model.output_shape
    except (AttributeError, ValueError):  # a subclassed model not built yet: checked at the first step
        output = None
    del model
    keras.backend.clear_session()
    one_output = isinstance(output, tuple) and all(isinstance(d, (int, type(None))) for d in output)
    _built[key] = tuple(output[1:]) if one_output else None
    return _built[key]
