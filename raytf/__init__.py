"""raytf: Ray-orchestrated distributed TensorFlow training.

    import raytf
    result = raytf.fit("jobs/digits.yaml", train__epochs=3)   # or overrides={"train.epochs": 3}
    sweep = raytf.tune("jobs/digits-sweep.yaml")              # a Ray Tune sweep of distributed jobs
"""
from __future__ import annotations

from typing import Any, Mapping

from raytf.driver.report import ProgressDisplay, Result
from raytf.errors import (
    PlacementTimeout,
    RaytfError,
    SpecError,
    TrainingFailed,
    WorkerStartupError,
)
from raytf.job import Job
from raytf.spec import JobSpec

__version__ = "0.1.0"


def fit(spec_or_path: "str | Mapping[str, Any] | JobSpec | Job", overrides: Mapping[str, Any] | None = None, *,
        address: str | None = None, display: ProgressDisplay | None = None, resume: "bool | str | None" = None,
        verbose: bool = False, **dotted_overrides: Any) -> Result:
    """Run one distributed training job and return its Result.

    `spec_or_path`: a job YAML path, a mapping, a JobSpec or a loaded Job. Overrides are dotted keys,
    either in `overrides` ({"train.epochs": 3}) or as keyword arguments with `__` for the dot
    (train__epochs=3). Without an initialised Ray, `address` (or RAY_ADDRESS) picks a cluster; with
    neither, an embedded local Ray runs for the duration of the call. `resume` (default: the spec's
    `resume` key): True continues from the latest checkpoint in checkpoint.dir (without it, a checkpoint.dir
    that holds checkpoints is an error); "auto" continues if there is a checkpoint, starts if not, and trains
    nothing if the run already succeeded in output.dir (a local folder or a URI such as s3://bucket/runs/m).
    `verbose`: Ray's and TensorFlow's own output too (the workers' logs, TensorFlow's start-up lines).
    """
    from raytf import job as job_lib

    merged = dict(overrides or {})
    merged.update({k.replace("__", "."): v for k, v in dotted_overrides.items()})
    if resume is not None:
        merged["resume"] = resume
    display = display or ProgressDisplay(quiet=True)
    from raytf.storage import Folder

    # A run that already succeeded in its storage (resume: auto) is answered from there, before its data is
    # read or its code imported: a retry of a finished job costs a second, not a TensorFlow start. This load
    # also checks that output.dir and checkpoint.dir can be written.
    shape = job_lib.load(spec_or_path, merged, check_data=False, check_code=False)
    storage = Folder(shape.output_where, "output.dir")
    from raytf.driver import lease as leases
    from raytf.driver import output

    # output.dir in storage is held by one live attempt across machines, from before the job's code is read.
    held = leases.Lease.acquire(storage, shape.spec.name) if storage.remote else None
    try:
        if held is not None:
            shipped = output.ship_leftover(storage, held)  # an earlier attempt's results, before reading its state
            if shipped:
                display.message(shipped)
        return _fit_held(spec_or_path, merged, shape, storage, held, address, display, verbose)
    finally:
        if held is not None:
            held.release()


def _fit_held(spec_or_path, merged, shape: Job, storage, held, address, display, verbose) -> Result:
    """fit, once output.dir is this driver's (its lease taken, for a URI). The job file is read once: the shape
    loaded above is completed here (its data read, its code imported)."""
    from raytf import job as job_lib
    from raytf.driver import attempts, packaging, quiet

    mode = shape.spec.resume
    previous = storage.read_json("result.json") if mode else None
    if mode == "auto" and attempts.succeeded(previous, shape.spec.name):
        display.message(f"raytf: resume: auto: {shape.spec.name} already succeeded in "
                        f"{storage.location('result.json')}; nothing to train (give another output.dir or name to "
                        f"train it again)")
        return Result.from_dict(previous)
    with quiet.native_noise_filtered(quiet.hide_native_noise(verbose)):
        job = job_lib.complete(shape)
    left_out = packaging.check_job_folder(job)
    if left_out:
        display.message(left_out)
    from raytf import tracking

    tracking.check_server(job)  # a tracking server that is not there is said before Ray starts

    from raytf.driver import run  # Ray: only once the spec is known to be good
    from raytf.driver.session import ray_session

    return run.execute(job, resume=mode, display=display, previous=previous, lease=held,
                       session=ray_session(address, verbose), verbose=verbose)


def tune(sweep_or_path: "str | Mapping[str, Any]", overrides: Mapping[str, Any] | None = None, *,
         address: str | None = None, display: ProgressDisplay | None = None, resume: bool = False,
         verbose: bool = False, **dotted_overrides: Any):
    """Run a Ray Tune sweep in which every trial is a distributed raytf job; return a SweepResult
    (rows, best trial, best job spec and model, sweep.json, sweep.png).

    `sweep_or_path`: a sweep YAML (a job spec plus a `tune:` section) or its mapping. Overrides as for
    `fit`; `tune.space.<spec key>` sets one dimension. Every point is validated before any trial starts
    (SpecError). `resume` continues a stopped sweep in the same output.dir. Ray and `verbose` as for `fit`.
    """
    from raytf import tuner
    from raytf.driver import packaging, quiet

    merged = dict(overrides or {})
    merged.update({k.replace("__", "."): v for k, v in dotted_overrides.items()})
    with quiet.native_noise_filtered(quiet.hide_native_noise(verbose)):
        plan = tuner.prepare(sweep_or_path, merged)  # a bad sweep fails here, before Ray starts
    left_out = packaging.check_job_folder(plan.base)
    display = display or ProgressDisplay(quiet=True)
    if left_out:
        display.message(left_out)
    from raytf import tracking

    tracking.check_server(plan.base)

    from raytf.driver.session import ray_session

    with ray_session(address, verbose) as logs_hint:
        if logs_hint:
            display.message(logs_hint)
        return tuner.run(plan, display=display, resume=resume, verbose=verbose)


__all__ = ["fit", "tune", "Job", "JobSpec", "Result", "ProgressDisplay", "RaytfError", "SpecError", "PlacementTimeout",
           "WorkerStartupError", "TrainingFailed"]
