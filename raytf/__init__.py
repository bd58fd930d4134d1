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
        address: str | None = None, display: ProgressDisplay | None = None, resume: bool = False,
        verbose: bool = False, **dotted_overrides: Any) -> Result:
    """Run one distributed training job and return its Result.

    `spec_or_path`: a job YAML path, a mapping, a JobSpec or a loaded Job. Overrides are dotted keys,
    either in `overrides` ({"train.epochs": 3}) or as keyword arguments with `__` for the dot
    (train__epochs=3). Without an initialised Ray, `address` (or RAY_ADDRESS) picks a cluster; with
    neither, an embedded local Ray runs for the duration of the call. `resume` continues from the
    latest checkpoint in checkpoint.dir (without it, a checkpoint.dir that holds checkpoints is an error).
    `verbose`: Ray's and TensorFlow's own output too (the workers' logs, TensorFlow's start-up lines).
    """
    from raytf import job as job_lib
    from raytf.driver import packaging, quiet

    merged = dict(overrides or {})
    merged.update({k.replace("__", "."): v for k, v in dotted_overrides.items()})
    with quiet.native_noise_filtered(quiet.hide_native_noise(verbose)):
        job = job_lib.load(spec_or_path, merged)
    left_out = packaging.check_job_folder(job)
    display = display or ProgressDisplay(quiet=True)
    if left_out:
        display.message(left_out)

    from raytf.driver import controller, output  # Ray: only once the spec is known to be good
    from raytf.driver.session import ray_session

    from raytf.checkpoint import resume_note

    note = resume_note(job.checkpoint_dir, resume)  # --resume and checkpoint.dir agree, before anything starts
    if note:
        display.message(note)
    with output.claim(job, resume), ray_session(address, verbose) as logs_hint:
        if logs_hint:
            display.message(logs_hint)
        return controller.run(job, display=display, resume=resume, verbose=verbose)


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

    from raytf.driver.session import ray_session

    with ray_session(address, verbose) as logs_hint:
        if logs_hint:
            display.message(logs_hint)
        return tuner.run(plan, display=display, resume=resume, verbose=verbose)


__all__ = ["fit", "tune", "Job", "JobSpec", "Result", "ProgressDisplay", "RaytfError", "SpecError", "PlacementTimeout",
           "WorkerStartupError", "TrainingFailed"]
