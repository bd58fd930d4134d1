"""Build the job's model once in the driver, before anything starts: a model function that cannot build
(a shape error, a typo in a layer's arguments) is one line naming the user's file and line in seconds,
instead of after reservation, actor start and TensorFlow's start-up in every worker (~30 s).

Only for raytf's loop under Keras 3 (a train_fn builds its own model; tf-keras is not this process's Keras).
The driver has imported Keras already for the loss, optimizer and metric names.
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path

from raytf.errors import SpecError, clip

_built: set[tuple[str, str]] = set()  # (job folder, model ref) built fine in this process: a sweep builds once


def check_model_builds(job, build) -> None:
    """Call the model function `build` with the job folder as the working directory (as in the actors);
    SpecError naming file:line and the exception if it raises or returns no Keras model, or when its output
    cannot take the data's label with the job's loss (spec.check_labels)."""
    from raytf.actor import raised
    from raytf.spec import check_labels

    spec, job_dir = job.spec, Path(job.job_dir)
    if spec.train_fn is not None or spec.train.keras == "legacy" or spec.model is None:
        return
    key = (str(job_dir), spec.model)
    if key in _built:
        return
    import keras

    here = os.getcwd()
    try:
        os.chdir(job_dir)
        model = build()
    except Exception as exc:
        frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
        where = raised.user_line(frames, str(exc), [str(job_dir)])
        raise SpecError(f"model: {spec.model} cannot be built: " + (f"{where}: " if where else "")
                        + f"{type(exc).__name__}: {clip(raised.summary(str(exc)))}") from None
    finally:
        os.chdir(here)
    if not isinstance(model, keras.Model):
        raise SpecError(f"model: {spec.model} returned {clip(repr(model), 100)}, not a Keras model; return e.g. "
                        f"keras.Sequential([...])")
    try:
        output = model.output_shape
    except (AttributeError, ValueError):  # a subclassed model not built yet: checked at the first step
        output = None
    del model
    keras.backend.clear_session()
    if isinstance(output, tuple) and all(isinstance(d, (int, type(None))) for d in output):  # one output
        check_labels(spec, job.datasets, tuple(output[1:]))
    _built.add(key)
