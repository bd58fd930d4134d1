"""A sweep's plan, before and around its trials: the sweep file read and every point checked (`prepare`), what
makes a trial's job from a point (`trial_overrides`, `Suggested`), how many trials run at once
(`concurrency`), and the names Tune's trials and their folders get. No Ray and no TensorFlow: the sweep's
driver (raytf.tuner), its trials (raytf.sweep_trial) and its result collection (raytf.sweep_results) share it.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Mapping

from raytf import job as job_lib
from raytf import job_code
from raytf import search, sweep, sweep_capacity
from raytf.driver import placement
from raytf.errors import PlacementTimeout, SpecError
from raytf.job import Job
from raytf.spec import JobSpec
from raytf.storage import is_uri, new_staging

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


def pauses(section: sweep.TuneSection) -> bool:
    """Whether the sweep's scheduler stops trials and starts them again (hyperband, pbt)."""
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
    # each point's job (or why it cannot run) as loaded in this process: the driver asks for one when Tune sizes
    # the trial, when it fails and when its results are read, and a load reads the Parquet footers
    _loaded: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:  # what a trial's actor gets: its own loads are its own
        return {**self.__dict__, "_loaded": {}}

    def point(self, pid: str, config: Mapping[str, Any]) -> sweep.Point:
        values = {k: sweep.plain(config[k]) for k in self.section.space if k in config}
        return sweep.Point(pid, values, sweep.point_overrides(values, self.base.spec, self.section, 0))

    def job(self, point: sweep.Point, check_storage: bool = True, check_fit: bool = True) -> Job:
        """The point's job, or UnrunnablePoint with the reason (a spec that does not hold, or, `check_fit`, a
        trial no set of the cluster's nodes, as they were when the sweep started, can hold)."""
        key = (point.id, repr(sorted(point.overrides.items())), check_storage, check_fit)
        if key not in self._loaded:
            try:
                self._loaded[key] = self._load(point, check_storage, check_fit)
            except UnrunnablePoint as exc:
                self._loaded[key] = exc
        found = self._loaded[key]
        if isinstance(found, UnrunnablePoint):
            raise UnrunnablePoint(str(found))
        return found

    def _load(self, point: sweep.Point, check_storage: bool, check_fit: bool) -> Job:
        try:
            job = job_lib.load(self.base, trial_overrides(self.base, point.id, point.overrides, pauses(self.section)),
                               check_code=False, check_storage=check_storage)
        except SpecError as exc:
            reason = str(exc).removeprefix(f"{self.source}: ")
            raise UnrunnablePoint(f"point {point.id} {point.describe()} cannot run: {reason}") from None
        bundles, strategy = trial_bundles(job.spec), job.spec.cluster.effective_placement
        if check_fit and sweep_capacity.trials_that_fit(self.nodes, bundles, strategy, limit=1) == 0:
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
    if pauses(section) and base_spec.train_fn is not None:
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
            jobs[pid] = job_lib.load(base, trial_overrides(base, pid, point_overrides, pauses(section)),
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
    fit = sweep_capacity.auto_concurrency(nodes, shapes, prepared.num_trials)
    if fit == 0:
        bundles, strategy = next(s for s in shapes if sweep_capacity.trials_that_fit(nodes, s[0], s[1], limit=1) == 0)
        have = placement.total([{k: v for k, v in n.items() if k in ("CPU", "GPU")} for n in nodes])
        raise PlacementTimeout(
            f"{prepared.source}: no trial fits this cluster: one asks for {len(bundles)} bundles of {bundles[0]} "
            f"({strategy}); the cluster has {have} in {len(nodes)} node(s). Lower cluster.workers or the "
            f"per-worker resources, add nodes, or set tune.max_concurrent_trials to a number to wait for an "
            f"autoscaler to add them")
    return fit


RESTORES = "restores.json"  # in a trial's output.dir: each start from a checkpoint Tune handed back


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


def trial_name(trial, section: sweep.TuneSection) -> str:
    return f"{point_of(trial, section)}_{trial.trial_id}"

