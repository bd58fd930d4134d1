"""Ray Tune sweeps in which every trial is a distributed raytf job.

    raytf tune sweep.yaml      (or raytf.tune("sweep.yaml"))
      prepare     sweep file -> base job + tune section; every point expanded and loaded as a job (imports,
                  data, divisibility) before Ray is touched: a bad point is an error naming it. With a
                  searcher (tune.search.algorithm optuna|hyperopt) only the base job is checked here: each
                  suggested point is checked inside its trial, and one that cannot run fails that trial
                  (UnrunnablePoint), which Tune tells the searcher
      run         the job folder uploaded once; max_concurrent_trials from the cluster's nodes; one Tune
                  trial per point, its placement group [{CPU: 0}, *worker bundles] (Tune drops the empty
                  head bundle, so the worker bundles keep indexes 0..n-1, as controller.run expects)
      trial       controller.run(job, on_epoch=tune.report, placement_group=the trial's group)
      report      table, sweep.json, the best trial as a job spec, sweep.png (sweep_report)

(The module is not called `tune` so that `raytf.tune`, the function, is never shadowed by it.)
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import io
import json
import shutil
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from raytf import job as job_lib
from raytf import job_code
from raytf import learning_rate, search, sweep, sweep_report, tracking
from raytf.driver import packaging, placement
from raytf.driver.report import ProgressDisplay
from raytf.errors import PlacementTimeout, SpecError
from raytf.job import Job
from raytf.spec import JobSpec
from raytf.storage import STAGING_MARK, Folder, is_uri, new_staging
from raytf.sweep_report import SweepResult

EXPERIMENT = "tune"  # Tune's experiment folder inside the sweep's output.dir
POINTS_FILE = "points.json"
BEST_SPEC = "best.yaml"  # the best trial as a job spec, in output.dir


class UnrunnablePoint(SpecError):
    """A point suggested by a searcher that cannot run as a job: its trial fails with the reason."""


def trial_overrides(base: Job, pid: str, point_overrides: dict[str, Any], pauses: bool = False) -> dict[str, Any]:
    """A point's job: its values, its own name and output.dir (and checkpoint.dir: trials never share one).
    Under a scheduler that stops and restarts trials (`pauses`), every trial checkpoints at each epoch's end
    (into <output.dir>/checkpoints/<point> unless checkpoint.dir is set): that is what Tune hands back."""
    out = {**point_overrides, "name": f"{base.spec.name}-{pid}", "output.dir": f"{base.output_where}/trials/{pid}"}
    if base.checkpoint_dir is not None:
        out["checkpoint.dir"] = f"{base.checkpoint_dir.rstrip('/')}/{pid}"
    elif pauses:
        out["checkpoint.dir"] = f"{base.output_where}/checkpoints/{pid}"
    mlflow = base.spec.tracking.mlflow
    if mlflow is not None:  # every trial's run in the sweep's experiment, nested in the sweep's run
        out["tracking.mlflow.experiment"] = mlflow.experiment or base.spec.name
    if pauses:  # kept until Tune has each one (then pruned by the trial): the driver's report may lag training
        out.update({"checkpoint.every_epochs": 1, "checkpoint.every_steps": None,
                    "checkpoint.keep": int(point_overrides.get("train.epochs", base.spec.train.epochs)) + 1})
    return out


def _pauses(section: sweep.TuneSection) -> bool:
    return section.scheduler is not None and section.scheduler.pauses


@dataclasses.dataclass
class Suggested:
    """What turns a trial config Tune filled in (a searcher's suggestion, a member of pbt's population: spec
    key -> value) into a job. Picklable: Tune's trial actors build their job from it; the driver uses it to
    size the trial and to read its results."""

    base: Job
    section: sweep.TuneSection
    source: str
    nodes: list[dict[str, float]]  # the cluster's resources, node by node, when the sweep started

    def point(self, pid: str, config: Mapping[str, Any]) -> sweep.Point:
        values = {k: sweep.plain(config[k]) for k in self.section.space if k in config}
        return sweep.Point(pid, values, sweep.point_overrides(values, self.base.spec, self.section, 0))

    def job(self, point: sweep.Point, check_storage: bool = True, check_fit: bool = True) -> Job:
        """The point's job, or UnrunnablePoint with the reason (a spec that does not hold, or, `check_fit`, a
        trial no set of the cluster's nodes, as they were when the sweep started, can hold)."""
        try:
            job = job_lib.load(self.base, trial_overrides(self.base, point.id, point.overrides, _pauses(self.section)),
                               check_code=False, check_storage=check_storage)
        except SpecError as exc:
            reason = str(exc).removeprefix(f"{self.source}: ")
            raise UnrunnablePoint(f"point {point.id} {point.describe()} cannot run: {reason}") from None
        bundles, strategy = trial_bundles(job.spec), job.spec.cluster.effective_placement
        if check_fit and sweep.trials_that_fit(self.nodes, bundles, strategy, limit=1) == 0:
            have = placement.total([{k: v for k, v in n.items() if k in ("CPU", "GPU")} for n in self.nodes])
            raise UnrunnablePoint(f"point {point.id} {point.describe()} cannot run: it asks for {len(bundles)} "
                                  f"bundles of {bundles[0]} ({strategy}); the cluster has {have}; narrow "
                                  f"tune.space or add nodes")
        return job


@dataclasses.dataclass
class PreparedSweep:
    """A validated sweep: the base job, the tune section and one loaded Job per point."""

    source: str
    job_raw: dict[str, Any]  # the sweep file's job part (overrides applied), for the best spec
    base: Job
    section: sweep.TuneSection
    points: list[sweep.Point]  # drawn up front (none when a searcher suggests them)
    jobs: dict[str, Job]  # point id -> its job (output.dir <sweep output>/trials/<point id>)
    rejected: list[dict[str, Any]]

    @property
    def suggests(self) -> bool:
        """Tune fills each trial's config (a searcher, or pbt's population): no points drawn up front."""
        return self.section.values_in_config

    @property
    def num_trials(self) -> int:
        return self.section.num_samples if self.suggests else len(self.points)

    @functools.cached_property
    def output_dir(self) -> Path:
        """Where this process writes the sweep's files: output.dir, or for a URI a fresh private staging folder
        of its own (raytf.storage.new_staging), made when first asked for."""
        if self.remote:
            return new_staging(f"{self.base.spec.name}-sweep")[0]
        return self.base.output_dir

    @property
    def output_where(self) -> str:
        """output.dir as given: a local path or a URI (s3://...), where Tune's state and every trial go."""
        return self.base.output_where

    @property
    def remote(self) -> bool:
        return is_uri(self.output_where)

    @property
    def experiment(self) -> str:
        return f"{self.output_where}/{EXPERIMENT}"

    def location(self, rel: str) -> str:
        """Where a sweep file ends up (a URI for output.dir on object storage)."""
        return f"{self.output_where}/{rel}"

    @property
    def max_t(self) -> int:
        """The scheduler's last rung, in epochs: given, or the most train.epochs of any trial."""
        given = self.section.scheduler.max_t if self.section.scheduler else None
        if given:
            return given
        if self.suggests:
            dim = self.section.space.get("train.epochs")
            return int(max(dim.values)) if dim is not None else self.base.spec.train.epochs
        return max(j.spec.train.epochs for j in self.jobs.values())

    @property
    def best_spec_path(self) -> Path:
        """In output.dir, like everything a sweep writes: the job folder holds only what the user put there."""
        return self.output_dir / BEST_SPEC


def trial_bundles(spec: JobSpec) -> list[dict[str, float]]:
    """The placement group one trial's job needs (the one place that knows a job's bundles for Tune)."""
    return placement.job_bundles(spec)


def prepare(source: "str | Path | Mapping[str, Any]", overrides: Mapping[str, Any] | None = None) -> PreparedSweep:
    """Read, override and validate a sweep; load every point's job. No Ray; raises SpecError."""
    if isinstance(source, Mapping):
        raw, start, name = dict(source), Path.cwd(), "sweep"
    else:
        path = Path(source).expanduser().resolve()
        raw, start, name = job_lib.read_yaml(path), path.parent, str(source)
    raw = sweep.apply_sweep_overrides(raw, overrides or {})
    job_raw, section = sweep.split_sweep(raw, name)
    base_spec = job_lib.parse(job_raw, name)
    sweep.check_metric(section, base_spec, name)
    base = Job(spec=base_spec, job_dir=job_lib.job_folder(base_spec, start, name), source=name)
    if _pauses(section) and base_spec.train_fn is not None:
        raise SpecError(f"{name}: tune.scheduler {section.scheduler.name} starts trials again from the checkpoint "
                        f"raytf's loop writes at each epoch's end, which a train_fn's own loop does not; use "
                        f"scheduler asha (it only stops trials), or raytf's loop")
    if (section.scheduler is not None and base_spec.train_fn is not None and not section.scheduler.max_t
            and "epochs" not in base_spec.train.model_fields_set):
        raise SpecError(f"{name}: tune.scheduler {section.scheduler.name} with a train_fn: the scheduler needs to "
                        f"know the last epoch, which your train_fn counts itself; set train.epochs to the epochs it "
                        f"runs (or tune.scheduler.max_t), e.g. train.epochs: 3")
    jobs: dict[str, Job] = {}

    def check(pid: str, point_overrides: dict[str, Any]) -> JobSpec:
        try:  # the code is imported once every point has passed the checks that need no TensorFlow
            jobs[pid] = job_lib.load(base, trial_overrides(base, pid, point_overrides, _pauses(section)),
                                     check_code=False)
            return jobs[pid].spec
        except SpecError as exc:
            raise SpecError(str(exc).removeprefix(f"{name}: ")) from None

    if section.values_in_config:  # only the base job is checked now; each suggestion in its trial
        try:  # (an override, or load hands the unchecked base back)
            if section.search.suggests:
                search.check_installed(section)
            sweep.point_overrides({}, base_spec, section, 0)  # lr_scaling against optimizer.scale_lr, as a grid's
            job_lib.load(base, {"name": base_spec.name})
            if not section.search.suggests:  # pbt explores each choice: every one must make a job
                for key, dim in section.space.items():
                    for value in dim.values if dim.kind == "choice" else ():
                        try:
                            job_lib.load(base, {key: value}, check_code=False, check_storage=False)
                        except SpecError as exc:
                            raise SpecError(f"tune.space.{key}: pbt explores every choice, and {value!r} cannot "
                                            f"run: {str(exc).removeprefix(f'{name}: ')}") from None
        except SpecError as exc:
            raise SpecError(f"{name}: {str(exc).removeprefix(f'{name}: ')}") from None
        prepared = PreparedSweep(name, job_raw, base, section, [], {}, [])
        _check_grace_period(prepared)
        return prepared
    try:
        points, rejected = sweep.expand(section, base_spec, check)
        for point in points:
            try:
                job_code.check_job_code(jobs[point.id].spec, jobs[point.id].job_dir, jobs[point.id].datasets)
            except SpecError as exc:
                raise SpecError(f"point {point.id} {point.describe()} cannot run: {exc}") from None
    except SpecError as exc:
        raise SpecError(f"{name}: {exc}") from None
    prepared = PreparedSweep(name, job_raw, base, section, points, {p.id: jobs[p.id] for p in points}, rejected)
    _check_grace_period(prepared)
    return prepared


def _check_grace_period(prepared: PreparedSweep) -> None:
    scheduler = prepared.section.scheduler
    if scheduler is not None and scheduler.grace_period > prepared.max_t:
        raise SpecError(f"{prepared.source}: tune.scheduler.grace_period {scheduler.grace_period} is more than "
                        f"max_t {prepared.max_t} (epochs); lower grace_period or raise train.epochs")


def concurrency(prepared: PreparedSweep, nodes: list[Mapping[str, float]]) -> int:
    """tune.max_concurrent_trials as a number: given, or (auto) what the nodes hold of the largest trial."""
    wanted = prepared.section.max_concurrent_trials
    if wanted != "auto":
        return min(wanted, prepared.num_trials)
    # A searcher's points are not known yet: sized for the base job's shape (one whose suggestion asks for
    # more waits for it, or fails as unrunnable when no set of nodes holds it).
    jobs = [prepared.base] if prepared.suggests else prepared.jobs.values()
    shapes = [(trial_bundles(j.spec), j.spec.cluster.effective_placement) for j in jobs]
    fit = sweep.auto_concurrency(nodes, shapes, prepared.num_trials)
    if fit == 0:
        bundles, strategy = next(s for s in shapes if sweep.trials_that_fit(nodes, s[0], s[1], limit=1) == 0)
        have = placement.total([{k: v for k, v in n.items() if k in ("CPU", "GPU")} for n in nodes])
        raise PlacementTimeout(
            f"{prepared.source}: no trial fits this cluster: one asks for {len(bundles)} bundles of {bundles[0]} "
            f"({strategy}); the cluster has {have} in {len(nodes)} node(s). Lower cluster.workers or the "
            f"per-worker resources, add nodes, or set tune.max_concurrent_trials to a number to wait for an "
            f"autoscaler to add them")
    return fit


# ---------------------------------------------------------------- inside a trial (a Tune actor)


def _run_trial(config: dict[str, Any], jobs: dict[str, Job], code_env: dict[str, Any],
               suggested: Suggested | None = None, pauses: bool = False, tracking_parent: str | None = None,
               reuse: bool = False) -> None:
    """One trial: the point's job on the trial's placement group, each epoch reported to Tune. A suggested
    point's job is built here; one that cannot run raises UnrunnablePoint, failing the trial at once.

    Under a scheduler that `pauses` (hyperband, pbt), each epoch's report carries the checkpoint of that
    epoch's end (raytf.trial_checkpoint); a trial Tune starts again with one (promoted, or given a better
    trial's by pbt) resumes from it, and the epochs it already holds are not reported again.

    The last epoch is reported only once the model is written: a scheduler stops a trial when it reaches
    max_t, and a stop ends the trial in that report (Tune's SystemExit), taking its raytf actors with it. A
    train_fn counts its own epochs (train.epochs may not say how many): each of its epochs is reported when the
    next one comes, the last once the job ended, so Tune hears them in order.

    With `reuse` (tune.reuse_processes, and no scheduler: see reuses_processes), Tune runs the next trial that
    asks for the same resources in this actor, on the same placement group, and a succeeded job's raytf actors
    stay for it (raytf.actor.reuse)."""
    import ray
    from ray import tune

    from raytf import trial_checkpoint
    from raytf.checkpoint import Storage
    from raytf.driver import controller, output

    config = {k: sweep.plain(v) for k, v in config.items()}  # as Tune filled it: NumPy scalars from some searchers
    if suggested is None:
        pid = config["point"]
        job = jobs[pid]
    else:
        pid = tune.get_context().get_trial_name().split("_", 1)[0]  # as _trial_name made it
        job = suggested.job(suggested.point(pid, config))
    storage = Storage(job.checkpoint_dir) if job.checkpoint_dir is not None else None
    last_epoch, done_epochs = job.spec.train.epochs, 0
    given = tune.get_checkpoint() if pauses and storage is not None else None
    if given is not None:  # promoted after a pause, or (pbt) given a better trial's state and new values
        with given.as_directory() as folder:
            origin = trial_checkpoint.unpack(folder, storage)
        done_epochs = origin["epoch"]
        _add_restore(job, {"after_epoch": done_epochs, "from": origin["point"], "step": origin["step"],
                           "from_config": origin["config"], "config": {k: v for k, v in config.items() if k != "point"}})
    elif pauses and storage is not None:  # a first start: what a crashed earlier run left is not this trial's
        trial_checkpoint.clear(storage)
    held: list[dict[str, Any]] = []
    own_count = job.spec.train_fn is not None  # a train_fn counts its own epochs: which is last is unknown

    def report(metrics: dict[str, Any]) -> None:
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        epoch = numbers.get("epoch")
        if epoch is not None and epoch <= done_epochs:  # reported before Tune stopped this trial
            return
        if own_count:  # each epoch told when the next one comes, the last once the job ended: in order
            held.append(numbers)
            while len(held) > 1:
                tune.report(held.pop(0))
            return
        if epoch == last_epoch:
            held.append(numbers)
            return
        saved = trial_checkpoint.at_epoch_end(storage, epoch) if pauses and storage and epoch else None
        if saved is None:
            tune.report(numbers)
            return
        folder = trial_checkpoint.pack(storage, saved, pid, {k: v for k, v in config.items() if k != "point"})
        try:
            tune.report(numbers, checkpoint=tune.Checkpoint.from_directory(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        trial_checkpoint.drop_before(storage, saved)  # Tune holds it now

    resume = storage is not None and storage.latest() is not None
    # A trial's output.dir on object storage: staged on this node, shipped up when the trial's job ends.
    staged = output.claim(job, resume) if is_uri(job.output_where) else contextlib.nullcontext(job)
    try:
        with staged as job:
            controller.run(job, on_epoch=report, placement_group=ray.util.get_current_placement_group(),
                           code_env=code_env, resume=resume, tracking_parent=tracking_parent, keep_processes=reuse)
        for metrics in held:
            tune.report(metrics)
    except BaseException:  # the job's workers, kept when it succeeded, are not for the next trial now
        if reuse:
            from raytf.driver.ray_group import drop_kept

            drop_kept()
        raise


RESTORES = "restores.json"  # in a trial's output.dir: each start from a checkpoint Tune handed back


def _add_restore(job: Job, entry: dict[str, Any]) -> None:
    folder = Folder(job.output_where, "output.dir")
    folder.write_json(RESTORES, [*(folder.read_json(RESTORES) or []), entry])


def reuses_processes(section: sweep.TuneSection, base: JobSpec | None = None) -> bool:
    """Whether trials run in the processes of the trials before them (raytf.actor.reuse). Not under a
    scheduler: Tune keeps the actor of a trial it stopped or paused for the next trial without ending the
    trial's function, whose workers would train on, unwatched, until that next trial comes. Not for a
    train_fn (see NO_REUSE_FOR_TRAIN_FN)."""
    return section.reuse_processes and section.scheduler is None and (base is None or base.train_fn is None)


# Only raytf's own loop runs the same collectives on every rank. A train_fn's code need not (tf-keras's
# model.save reads a sync-on-read metric through an all-reduce): in a reused group whose ranks' collective
# state differs, the next trial's save blocked on the chief while rank 1 had returned (2 of 2 sweeps).
NO_REUSE_FOR_TRAIN_FN = ("raytf: each trial starts new processes: a train_fn's own collectives (tf-keras's model.save "
                         "among them) can leave its ranks out of step, and a reused group then hangs "
                         "(tune.reuse_processes applies to raytf's own loop)")


def point_of(trial, section: sweep.TuneSection) -> str:
    """The point id of a Tune trial: given in its config (grid, random), or its place in the order Tune made
    it (a searcher's suggestion, pbt's population: t00, t01, ...)."""
    return trial.config.get("point") or search.point_id(trial.experiment_tag, section)


def _trial_name(trial, section: sweep.TuneSection) -> str:
    return f"{point_of(trial, section)}_{trial.trial_id}"


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
    at_once = ("as many at once as the cluster holds" if search.creates_every_trial_at_once(section)
               else f"up to {limit} at once")
    display.message(f"raytf: sweep {prepared.base.spec.name}: {prepared.num_trials} trials{how}, {at_once}"
                    + (f" ({len(prepared.rejected)} random draws rejected)" if prepared.rejected else "")
                    + f"; output {where}")
    packaging.mark_output(out)  # a later job in the same job folder leaves the sweep's outputs out
    storage.write_json(POINTS_FILE, _points_state(prepared))

    code_env = packaging.upload_code(packaging.runtime_env(prepared.base), verbose=verbose, note=display.message)
    _unpack_everywhere(code_env, display)
    suggested = Suggested(prepared.base, section, prepared.source, [dict(n) for n in nodes]) \
        if prepared.suggests else None
    if suggested is None:
        factories = {pid: tune.PlacementGroupFactory([{"CPU": 0}, *trial_bundles(job.spec)],
                                                     strategy=job.spec.cluster.effective_placement.upper())
                     for pid, job in prepared.jobs.items()}
        resources = lambda config: factories[config["point"]]  # noqa: E731
    else:
        resources = lambda config: _suggested_resources(suggested, config)  # noqa: E731
    pauses = _pauses(section)
    reuse = reuses_processes(section, prepared.base.spec)
    if section.reuse_processes and section.scheduler is None and not reuse:
        display.message(NO_REUSE_FOR_TRAIN_FN)
    parent = tracking.open_sweep_run(prepared, display.message)  # None without tracking.mlflow
    finished, ended = False, "failed"
    try:  # from the parent run's opening on: whatever ends the sweep closes it
        trainable = tune.with_resources(tune.with_parameters(
            _run_trial, jobs=prepared.jobs, code_env=code_env, suggested=suggested, pauses=pauses,
            tracking_parent=parent.run_id if parent else None, reuse=reuse), resources=resources)
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
            trial_name = functools.partial(_trial_name, section=section)
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
                                            trial_name_creator=trial_name,
                                            reuse_actors=reuse,
                                            trial_dirname_creator=trial_name),
                run_config=tune.RunConfig(name=EXPERIMENT, storage_path=where, verbose=0,
                                          # a paused or exploited trial starts from its last report's checkpoint
                                          # (pbt: all of them, or a donor's may go before a waiting trial takes it)
                                          checkpoint_config=tune.CheckpointConfig(
                                              num_to_keep=4 if pauses and section.scheduler.name == "hyperband" else None),
                                          callbacks=[_progress_callback(display.quiet, descriptions, section.metric,
                                                                        epochs, section, suggested)]),
            )
        with _quiet_tune_console(verbose):
            tuner.fit()
        wall = time.time() - started
        result = _collect(prepared, experiment, limit, started, wall, float(ray.cluster_resources().get("CPU", 0)),
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


def _unpack_everywhere(code_env: dict[str, Any], display: ProgressDisplay, timeout_s: float = 120.0) -> None:
    """Unpack the job folder on every node before any trial starts. Ray unpacks a working_dir on a node
    the first time that node's runtime-env agent meets it, replacing any copy already there: where nodes
    share a disk (several raylets on one machine, as in ray.cluster_utils), a later trial's first actor on
    one node would pull the folder from under the running actors of another node (their working directory
    vanishes: FileNotFoundError). Unpacking first also takes the download off every trial's start."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, max_retries=0)
    def unpacked() -> str:
        return os.getcwd()

    refs = [unpacked.options(runtime_env=code_env, scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["NodeID"], soft=False)).remote() for node in ray.nodes() if node.get("Alive")]
    try:
        ray.get(refs, timeout=timeout_s)
    except Exception as exc:  # best effort: trials unpack it themselves anyway
        display.message(f"raytf: could not unpack the job folder on every node first ({type(exc).__name__}); "
                        f"trials will unpack it as they start")


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
    if _pauses(prepared.section):
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


def _trial_point(prepared: PreparedSweep, suggested: Suggested | None, trial) -> tuple[sweep.Point, Job | None, str | None]:
    """A Tune trial's point, its job, and why it could not run (a suggested point only)."""
    pid = point_of(trial, prepared.section)
    if suggested is None:
        return next(p for p in prepared.points if p.id == pid), prepared.jobs[pid], None
    point = suggested.point(pid, trial.config)
    try:  # the spec only: the cluster of now may not be the one the trial met (an autoscaler, a resume)
        job = suggested.job(point, check_storage=False, check_fit=False)
    except UnrunnablePoint as exc:
        return point, None, str(exc)
    failed = _error_line(trial) if trial.status == "ERROR" else ""
    if f"{UnrunnablePoint.__name__}: " in failed:  # the trial found no set of nodes to hold it
        return point, None, failed.split(f"{UnrunnablePoint.__name__}: ", 1)[1]
    return dataclasses.replace(point, learning_rate=learning_rate.peak(job.spec)), job, None


def _planned_epochs(spec: JobSpec | None, epochs: int, saved: dict[str, Any]) -> int:
    """The epochs a trial was to run: train.epochs for raytf's loop; a train_fn counts its own, and its job
    succeeding is what says it ran them all."""
    if spec is None:
        return epochs
    if spec.train_fn is None:
        return spec.train.epochs
    return epochs if saved.get("status") == "succeeded" else epochs + 1


def _collect(prepared: PreparedSweep, experiment: str, limit: int, started: float, wall: float,
             cluster_cpus: float, suggested: Suggested | None = None) -> SweepResult:
    """Rows from Tune's stored trials and raytf's result.json files; then every output of the sweep."""
    from ray.tune import ExperimentAnalysis

    section = prepared.section
    analysis = ExperimentAnalysis(experiment, default_metric=section.metric, default_mode=section.mode)
    by_point = {}
    rows = []
    for trial in analysis.trials:
        point, job, unrunnable = _trial_point(prepared, suggested, trial)
        by_point[point.id] = point
        history = _history(_reports(prepared, analysis, trial), section.metric)
        last = trial.last_result or {}
        epochs = int(last.get("epoch", len(history)) or 0)
        spec = job.spec if job is not None else None
        saved = Folder(job.output_where, "output.dir").read_json("result.json") or {} if job is not None else {}
        rows.append({
            "point": point.id, "trial_id": trial.trial_id,
            "status": sweep_report.UNRUNNABLE if unrunnable else
            sweep_report.trial_status(trial.status, epochs, _planned_epochs(spec, epochs, saved)),
            "config": point.values,
            "global_batch_size": point.values.get("train.global_batch_size",
                                                  prepared.base.spec.train.global_batch_size) if spec is None
            else spec.train.global_batch_size,
            "learning_rate": learning_rate.peak(spec) if spec is not None else None,
            "workers": (spec or prepared.base.spec).cluster.workers,
            "final": history[-1] if history else None,
            "best": sweep_report.best_of(history, section.mode),
            "history": history,
            "epochs": epochs,
            "time_s": last.get("time_total_s"),
            "reported_at": last.get("timestamp"),  # the last report, seconds since the epoch
            "cpus": sum(b.get("CPU", 0) for b in trial_bundles(spec)) if spec is not None else 0,
            "output_dir": job.output_where if job is not None else None,
            "model_path": saved.get("model_path"),
            "exports": saved.get("exports", {}),
            # each start from a checkpoint Tune handed back: after which epoch, from which trial (itself after a
            # hyperband pause; a better one in pbt's exploit), at which step, with which values
            "restores": Folder(job.output_where, "output.dir").read_json(RESTORES) or [] if job is not None else [],
            "error": unrunnable or (_error_line(trial) if trial.status == "ERROR" else None),
        })
    rows.sort(key=lambda r: r["point"])
    best = sweep_report.best_row(rows, section.mode)
    out = prepared.output_dir
    best_spec_path = None
    if best is not None:
        point = by_point[best["point"]]
        # It lives in output.dir, so base_dir points back at the job folder (its code, its data) and
        # output.dir (relative to that folder) at <sweep output>/best. In object storage it is read from
        # anywhere: base_dir is the job folder's absolute path and output.dir a URI.
        if prepared.remote:
            rel_out, base_dir = f"{prepared.output_where}/best", str(prepared.base.job_dir)
            run_it = f"download {prepared.output_where}/{BEST_SPEC}, then raytf run {BEST_SPEC}"
        else:
            rel_out = _relative(out / "best", prepared.base.job_dir)
            base_dir = _relative(prepared.base.job_dir, prepared.best_spec_path.parent)
            run_it = f"raytf run {_relative(prepared.best_spec_path, Path.cwd())}"
        header = (f"The best trial of the sweep {prepared.source} ({best['point']}: {section.metric} "
                  f"{best['final']:.4g} after {best['epochs']} epochs).\n"
                  + (f"Its model came through pbt's exploits (trials/{best['point']}/restores.json): these are its "
                     f"last values, and training them from scratch need not reach the same model.\n"
                     if best.get("restores") and any(r["from"] != best["point"] for r in best["restores"]) else "")
                  + f"Run it: {run_it}")
        text = sweep_report.best_spec_yaml(prepared.job_raw, {**point.overrides, "name": f"{prepared.base.spec.name}-best",
                                                          "base_dir": base_dir, "output.dir": rel_out}, header)
        sweep_report.write_text(prepared.best_spec_path, text)
        best_spec_path = prepared.location(BEST_SPEC)
    # Utilization of this run only: trials that finished in an earlier run (before a resume) do not count.
    busy = sum((r["time_s"] or 0) * r["cpus"] for r in rows if (r["reported_at"] or 0) >= int(started))
    utilization = busy / (wall * cluster_cpus) if wall > 0 and cluster_cpus > 0 else None
    space_keys = list(section.space)
    text_table = sweep_report.table(rows, section.metric, space_keys, best)
    plot_path = sweep_report.plot(rows, section.metric, section.mode, out / "sweep.png",
                                  f"{prepared.base.spec.name}: final {section.metric} ({section.mode})")
    result = SweepResult(
        name=prepared.base.spec.name, metric=section.metric, mode=section.mode, output_dir=prepared.output_where,
        rows=rows,
        best=best, best_spec_path=best_spec_path, best_model_path=best["model_path"] if best else None,
        best_exports=best["exports"] if best else {},
        sweep_json=prepared.location("sweep.json"), plot_path=prepared.location("sweep.png") if plot_path else None,
        table=text_table,
        max_concurrent_trials=limit, rejected=prepared.rejected, wall_s=round(wall, 3),
        utilization=None if utilization is None else round(utilization, 4),
        interrupted=any(r["status"] == sweep_report.UNFINISHED for r in rows) or len(rows) < prepared.num_trials,
        search={"algorithm": section.search.algorithm, "path": sweep_report.search_path(rows, section.mode),
                "lineage": sweep_report.lineage(rows)})
    sweep_report.write_json(out / "sweep.json", result.to_dict())
    return result


def _reports(prepared: PreparedSweep, analysis, trial) -> list[dict[str, Any]]:
    """A trial's reports as Tune wrote them to its progress.csv. (ExperimentAnalysis's dataframe of a trial Tune
    paused and restored can miss reports: it was seen holding one epoch of two.)"""
    text = Folder(prepared.experiment, "output.dir").read_bytes(f"{_trial_name(trial, prepared.section)}/progress.csv")
    if text:
        return list(csv.DictReader(io.StringIO(text.decode())))
    frame = analysis.trial_dataframes.get(trial.trial_id)
    return frame.to_dict("records") if frame is not None else []


def _history(reports: list[dict[str, Any]], metric: str) -> list[float]:
    """The metric per epoch, in order. A trial run again after a resume may have reported an epoch twice:
    the later report wins."""
    def number(value) -> float | None:  # NaN stays (a diverged epoch); missing or empty is None
        try:
            return float(value)
        except (TypeError, ValueError):
            return None

    values = [(number(r.get("epoch")), number(r.get(metric))) for r in reports]
    values = [(None if e != e else e, v) for e, v in values]  # e != e: a NaN epoch
    if any(e is None for e, v in values if v is not None):  # reports without epochs: in order
        return [v for _, v in values if v is not None]
    by_epoch = {int(e): v for e, v in values if v is not None}
    return [by_epoch[e] for e in sorted(by_epoch)]


def _relative(path: Path, base: Path) -> str:
    try:
        return os.path.relpath(path, base)
    except ValueError:  # another drive
        return str(path)


def _error_line(trial) -> str:
    """The last line of the trial's error (the exception and its message)."""
    try:
        text = trial.get_error() or ""
    except OSError:
        text = ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else "failed"
