"""The driver of a Ray Tune sweep in which every trial is a distributed raytf job.

    raytf tune sweep.yaml      (or raytf.tune("sweep.yaml"))
      prepare     the sweep file and every point checked before Ray is touched (raytf.sweep_plan)
      run         the job folder uploaded once; max_concurrent_trials from the cluster's nodes; one Tune
                  trial per point, its placement group [{CPU: 0}, *worker bundles] (Tune drops the empty
                  head bundle, so the worker bundles keep indexes 0..n-1, as the controller expects)
      trial       the point's job through the run lifecycle, Tune's report a callback (raytf.sweep_trial)
      collect     table, sweep.json, the best trial as a job spec, sweep.png (raytf.sweep_results)

(The module is not called `tune` so that `raytf.tune`, the function, is never shadowed by it.)
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import time
import warnings
from typing import Any, Mapping

from raytf import search, sweep, tracking
from raytf.driver import packaging
from raytf.driver.report import ProgressDisplay
from raytf.errors import SpecError
from raytf.storage import STAGING_MARK, Folder
from raytf.sweep_plan import (
    EXPERIMENT,
    NO_REUSE_FOR_TRAIN_FN,
    POINTS_FILE,
    PreparedSweep,
    Suggested,
    UnrunnablePoint,
    concurrency,
    pauses,
    point_of,
    prepare,
    reuses_processes,
    trial_bundles,
    trial_name,
)
from raytf.sweep_results import collect
from raytf.sweep_trial import run_trial
from raytf.sweep_report import SweepResult

__all__ = ["prepare", "run", "concurrency", "reuses_processes", "PreparedSweep", "Suggested", "UnrunnablePoint"]


def _suggested_resources(suggested: Suggested, config: Mapping[str, Any]):
    """A suggested trial's placement group, sized from its point; a point that cannot run gets a sliver of
    a CPU, enough to start the trial that fails with the reason (so the searcher is told)."""
    from ray import tune

    try:
        job = suggested.job(suggested.point("t", config), check_storage=False)
    except UnrunnablePoint:
        return tune.PlacementGroupFactory([{"CPU": 0.01}])
    return tune.PlacementGroupFactory([{"CPU": 0}, *trial_bundles(job.spec)],
                                      strategy=job.spec.cluster.effective_placement.upper())


def _progress_callback(quiet: bool, descriptions: dict[str, str], metric: str, epochs: dict[str, int],
                       section: sweep.TuneSection, suggested: Suggested | None):
    from ray.tune import Callback

    class Progress(Callback):
        """One line per trial start, epoch, end and error. Pickled with the Tuner's state (for resume):
        it keeps only plain data and opens its display on first use."""

        def __init__(self):
            self.quiet, self.descriptions, self.metric, self.epochs = quiet, descriptions, metric, epochs
            self.section, self.suggested = section, suggested
            self._display = None

        def __getstate__(self):
            return {k: v for k, v in self.__dict__.items() if k != "_display"}

        def __setstate__(self, state):
            self.__dict__.update(state, _display=None)

        def _say(self, text: str) -> None:
            if self._display is None:
                self._display = ProgressDisplay(quiet=self.quiet)
            self._display.message(text)

        def on_trial_start(self, iteration, trials, trial, **info):
            pid = point_of(trial, self.section)
            described = self.descriptions.get(pid) or sweep.Point(pid, {k: v for k, v in trial.config.items()
                                                                        if k != "point"}, {}).describe()
            done = (trial.last_result or {}).get("epoch")
            self._say(f"raytf: {pid} " + (f"continues after epoch {done} from a checkpoint: " if done else "started: ")
                      + described)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            pid = point_of(trial, self.section)
            value = result.get(self.metric)
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            self._say(f"raytf: {pid} epoch {result.get('epoch', result.get('training_iteration'))}/"
                      f"{self.epochs.get(pid, self.epochs.get('*', '?'))}: {self.metric} {shown}")

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._say(f"raytf: {point_of(trial, self.section)} ended")

        def on_trial_error(self, iteration, trials, trial, **info):
            pid = point_of(trial, self.section)
            if self.suggested is not None:
                try:
                    self.suggested.job(self.suggested.point(pid, trial.config), check_storage=False)
                except UnrunnablePoint as exc:  # "point t03 {...} cannot run: <why>"
                    self._say(f"raytf: {exc}")
                    return
            self._say(f"raytf: {pid} failed (see the table at the end)")

    return Progress()


# ---------------------------------------------------------------- the driver


def run(prepared: PreparedSweep, display: ProgressDisplay | None = None, resume: bool = False,
        verbose: bool = False) -> SweepResult:
    """Run (or, with `resume`, continue) the sweep on the Ray this process is connected to."""
    display = display or ProgressDisplay(quiet=True)
    storage = Folder(prepared.output_where, "output.dir")
    held = None
    if prepared.remote:  # one live sweep per output.dir across machines (its trials live under it)
        from raytf.driver.lease import Lease

        storage.check_writable()
        held = Lease.acquire(storage, f"{prepared.base.spec.name}-sweep")
    try:
        return _run_held(prepared, display, resume, verbose, storage)
    finally:
        if held is not None:
            held.release()


def _run_held(prepared: PreparedSweep, display: ProgressDisplay, resume: bool, verbose: bool,
              storage: Folder) -> SweepResult:
    import ray
    from ray import tune

    out, where = prepared.output_dir, prepared.output_where
    experiment = prepared.experiment
    restoring = _check_state(prepared, resume, experiment, display)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    limit = concurrency(prepared, nodes)
    section = prepared.section
    how = (f" suggested by {section.search.algorithm}" if section.search.suggests
           else " (pbt's population)" if prepared.suggests else "")
    display.message(f"raytf: sweep {prepared.base.spec.name}: {prepared.num_trials} trials{how}, "
                    f"{search.how_many_at_once(section, limit)}"
                    + (f" ({len(prepared.rejected)} random draws rejected)" if prepared.rejected else "")
                    + f"; output {where}")
    packaging.mark_output(out)  # a later job in the same job folder leaves the sweep's outputs out
    storage.write_json(POINTS_FILE, _points_state(prepared))

    code = packaging.pack_code(prepared.base, verbose=verbose, note=display.message)  # once, for every trial
    suggested = Suggested(prepared.base, section, prepared.source, [dict(n) for n in nodes]) \
        if prepared.suggests else None
    if suggested is None:
        factories = {pid: tune.PlacementGroupFactory([{"CPU": 0}, *trial_bundles(job.spec)],
                                                     strategy=job.spec.cluster.effective_placement.upper())
                     for pid, job in prepared.jobs.items()}
        resources = lambda config: factories[config["point"]]  # noqa: E731
    else:
        resources = lambda config: _suggested_resources(suggested, config)  # noqa: E731
    paused = pauses(section)
    reuse = reuses_processes(section, prepared.base.spec)
    if section.reuse_processes and section.scheduler is None and not reuse:
        display.message(NO_REUSE_FOR_TRAIN_FN)
    parent = tracking.open_sweep_run(prepared, display.message)  # None without tracking.mlflow
    finished, ended = False, "failed"
    try:  # from the parent run's opening on: whatever ends the sweep closes it
        trainable = tune.with_resources(tune.with_parameters(
            run_trial, jobs=prepared.jobs, code=code, suggested=suggested, pauses=paused,
            tracking_parent=parent.run_id if parent else None, reuse=reuse,
            scheduler=section.scheduler.name if section.scheduler else None), resources=resources)
        started = time.time()
        if restoring:
            display.message(f"raytf: resuming the sweep in {experiment}")
            tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_unfinished=True)
        else:
            descriptions = {p.id: p.describe() for p in prepared.points}
            # a train_fn's own epoch count is its own ("?" unless train.epochs says it)
            own_count = (prepared.base.spec.train_fn is not None
                         and "epochs" not in prepared.base.spec.train.model_fields_set)
            epochs = {pid: "?" if own_count else j.spec.train.epochs
                      for pid, j in prepared.jobs.items()} or {"*": prepared.max_t}
            named = functools.partial(trial_name, section=section)
            if suggested is None:  # Tune runs the points drawn up front, one trial each
                param_space, num_samples = {"point": tune.grid_search([p.id for p in prepared.points])}, 1
            else:
                param_space, num_samples = search.param_space(section), section.num_samples
            tuner = tune.Tuner(
                trainable,
                param_space=param_space,
                tune_config=tune.TuneConfig(metric=section.metric, mode=section.mode,
                                            scheduler=search.scheduler(section, prepared.max_t),
                                            search_alg=search.search_algorithm(section), num_samples=num_samples,
                                            max_concurrent_trials=None if search.creates_every_trial_at_once(section)
                                            else limit,
                                            trial_name_creator=named,
                                            reuse_actors=reuse,
                                            trial_dirname_creator=named),
                run_config=tune.RunConfig(name=EXPERIMENT, storage_path=where, verbose=0,
                                          # a paused or exploited trial starts from its last report's checkpoint
                                          # (pbt: all of them, or a donor's may go before a waiting trial takes it)
                                          checkpoint_config=tune.CheckpointConfig(
                                              num_to_keep=4 if paused and section.scheduler.name == "hyperband" else None),
                                          callbacks=[_progress_callback(display.quiet, descriptions, section.metric,
                                                                        epochs, section, suggested)]),
            )
        with _quiet_tune_console(verbose):
            tuner.fit()
        wall = time.time() - started
        result = collect(prepared, experiment, limit, started, wall, float(ray.cluster_resources().get("CPU", 0)),
                          suggested)
        # Tune takes the first Ctrl-C itself: fit() returns, and the sweep is interrupted, not finished
        finished, ended = True, "interrupted" if result.interrupted else "succeeded"
        return result
    except KeyboardInterrupt:
        ended = "interrupted"
        raise
    finally:
        tracking.finish_sweep_run(parent, out, ended)
        if prepared.remote:  # sweep.json, sweep.png, best.yaml: written here, kept there (whatever was written)
            from raytf.driver.output import ship

            ship(out, storage, failing=not finished)
            if all(p.name == STAGING_MARK for p in out.iterdir()):  # all shipped: the folder goes
                shutil.rmtree(out, ignore_errors=True)


class _NoRepeats(logging.Filter):
    """A point that cannot run is one line of raytf's, not Tune's 40-line traceback; and the trials that did
    not complete are in raytf's table, not in one more ERROR line of Tune's."""

    def __init__(self, verbose: bool = False):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{record.getMessage()} {exc!r}"
        if text.startswith("Trial task failed"):  # a failed trial: raytf's one line per trial, Tune's with -v
            return self.verbose
        return "UnrunnablePoint" not in text and not text.startswith("Trials did not complete")


@contextlib.contextmanager
def _quiet_tune_console(verbose: bool = False):
    """Tune's console tables give way to raytf's one line per trial event: with RAY_AIR_NEW_OUTPUT=0 and
    verbose=0 Tune prints nothing (its new output still prints a banner at verbose=0)."""
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    loggers, no_repeats = [logging.getLogger("ray.tune.execution.tune_controller"), logging.getLogger("ray.tune.tune")], _NoRepeats(verbose)
    for log in loggers:
        log.addFilter(no_repeats)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Consider boosting PBT performance")  # restarts are ours
            yield
    finally:
        for log in loggers:
            log.removeFilter(no_repeats)
        if before is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


def _points_state(prepared: PreparedSweep) -> list[dict[str, Any]]:
    """What a resume must find unchanged: the points drawn up front, or what the searcher searches."""
    if prepared.suggests:
        s = prepared.section
        state = [{"id": "search", "values": {"algorithm": s.search.algorithm, "seed": s.seed, "num_samples": s.num_samples,
                                             "space": {k: d.describe() for k, d in s.space.items()},
                                             "points_to_evaluate": s.search.points_to_evaluate}}]
    else:
        state = [{"id": p.id, "values": p.values, "overrides": p.overrides} for p in prepared.points]
    return json.loads(json.dumps(state))


def _check_state(prepared: PreparedSweep, resume: bool, experiment: str, display: ProgressDisplay) -> bool:
    """Whether to restore. A sweep folder that already holds a sweep needs --resume, and the same points."""
    from ray.tune import Tuner

    exists = Tuner.can_restore(experiment)
    where = prepared.output_where
    if not resume:
        if exists:
            raise SpecError(f"{prepared.source}: output.dir {where} already holds a sweep; pass --resume to "
                            f"continue it, or choose another output.dir (e.g. --set output.dir=...)")
        return False
    if not exists:
        display.message(f"raytf: --resume: no sweep in {where} yet; starting it")
        return False
    if pauses(prepared.section):
        raise SpecError(f"{prepared.source}: a tune.scheduler {prepared.section.scheduler.name} sweep cannot be resumed "
                        f"yet: Tune does not keep its scheduler's state (brackets, population) across a restore, and "
                        f"a restored hyperband would wait forever on trials that ended; start it again in another "
                        f"output.dir (e.g. --set output.dir=...)")
    saved = Folder(where, "output.dir").read_json(POINTS_FILE)
    if saved is not None and saved != _points_state(prepared):
        now = {p["id"]: p for p in _points_state(prepared)}
        changed = next((p for p in saved if now.get(p["id"]) != p), saved[0] if saved else None)
        detail = f" (point {changed['id']} was {changed['values']}, now {now.get(changed['id'], {}).get('values')})" \
            if changed else ""
        raise SpecError(f"{prepared.source}: the sweep changed since it was started in {where}{detail}; "
                        f"undo the change to resume it, or choose another output.dir")
    return True
