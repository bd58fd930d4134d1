"""Inside one trial of a sweep (a Ray Tune actor): the point's job run through the run lifecycle every job
goes through (raytf.driver.run), on the trial's placement group, with Tune's report as one more callback.
"""
from __future__ import annotations

import shutil
from typing import Any

from raytf import sweep
from raytf.driver.callbacks import Callback, TrialStopped
from raytf.job import Job
from raytf.protocol import TaskCode
from raytf.storage import Folder
from raytf.sweep_plan import RESTORES, Suggested


class TuneReport(Callback):
    """Each epoch to Tune, in order and once; under a scheduler that `pauses` with that epoch's checkpoint.

    The last epoch is reported only once the model is written (`report_held`, after the job): a scheduler
    stops a trial when it reaches max_t, and a stop ends the trial in that report, taking its raytf actors
    with it. A train_fn counts its own epochs (train.epochs may not say how many): each of its epochs is
    reported when the next one comes, the last once the job ended. A stop during the job is a TrialStopped:
    the trial's result.json says "stopped" and why."""

    def __init__(self, job: Job, pid: str, config: dict[str, Any], storage, pauses: bool, done_epochs: int,
                 scheduler: str | None):
        self.job, self.pid, self.config, self.storage = job, pid, config, storage
        self.pauses, self.done_epochs, self.scheduler = pauses, done_epochs, scheduler
        self.own_count = job.spec.train_fn is not None  # a train_fn counts its own epochs: which is last is unknown
        self.held: list[dict[str, Any]] = []

    def on_epoch(self, metrics: dict[str, Any]) -> None:
        from raytf import trial_checkpoint

        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        epoch = numbers.get("epoch")
        if epoch is not None and epoch <= self.done_epochs:  # reported before Tune stopped this trial
            return
        if self.own_count:  # each epoch told when the next one comes, the last once the job ended: in order
            self.held.append(numbers)
            while len(self.held) > 1:
                self._report(self.held.pop(0))
            return
        if epoch == self.job.spec.train.epochs:
            self.held.append(numbers)
            return
        storage = self.storage
        saved = trial_checkpoint.at_epoch_end(storage, epoch) if self.pauses and storage and epoch else None
        if saved is None:
            self._report(numbers)
            return
        folder = trial_checkpoint.pack(storage, saved, self.pid, self.config)
        try:
            from ray import tune

            self._report(numbers, checkpoint=tune.Checkpoint.from_directory(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        trial_checkpoint.drop_before(storage, saved)  # Tune holds it now

    def report_held(self) -> None:
        """The epochs held back, once the job has ended (a stop here ends a trial that succeeded)."""
        from ray import tune

        for metrics in self.held:
            tune.report(metrics)

    def _report(self, metrics: dict[str, Any], checkpoint=None) -> None:
        from ray import tune

        try:
            tune.report(metrics, checkpoint=checkpoint)
        except SystemExit:  # Tune's way to end a trial its scheduler stopped (or paused, to promote it later)
            how = "paused or stopped" if self.pauses else "stopped early"
            raise TrialStopped(f"{how} by tune.scheduler {self.scheduler} after epoch {metrics.get('epoch')}") \
                from None


def run_trial(config: dict[str, Any], jobs: dict[str, Job], code: TaskCode,
              suggested: Suggested | None = None, pauses: bool = False, tracking_parent: str | None = None,
              reuse: bool = False, scheduler: str | None = None) -> None:
    """One trial: the point's job on the trial's placement group, each epoch reported to Tune (TuneReport). A
    suggested point's job is built here; one that cannot run raises UnrunnablePoint, failing the trial at once.

    Under a scheduler that `pauses` (hyperband, pbt), each epoch's report carries the checkpoint of that
    epoch's end (raytf.trial_checkpoint); a trial Tune starts again with one (promoted, or given a better
    trial's by pbt) resumes from it, and the epochs it already holds are not reported again.

    With `reuse` (tune.reuse_processes, and no scheduler: see sweep_plan.reuses_processes), Tune runs the next
    trial that asks for the same resources in this actor, on the same placement group, and a succeeded job's
    raytf actors stay for it (raytf.actor.reuse)."""
    import ray
    from ray import tune

    from raytf import trial_checkpoint
    from raytf.checkpoint import Storage
    from raytf.driver import run
    from raytf.driver.report import ProgressDisplay

    config = {k: sweep.plain(v) for k, v in config.items()}  # as Tune filled it: NumPy scalars from some searchers
    if suggested is None:
        pid = config["point"]
        job = jobs[pid]
    else:
        pid = tune.get_context().get_trial_name().split("_", 1)[0]  # as sweep_plan.trial_name made it
        job = suggested.job(suggested.point(pid, config))
    values = {k: v for k, v in config.items() if k != "point"}
    storage = Storage(job.checkpoint_dir) if job.checkpoint_dir is not None else None
    done_epochs = 0
    given = tune.get_checkpoint() if pauses and storage is not None else None
    if given is not None:  # promoted after a pause, or (pbt) given a better trial's state and new values
        with given.as_directory() as folder:
            origin = trial_checkpoint.unpack(folder, storage)
        done_epochs = origin["epoch"]
        _add_restore(job, {"after_epoch": done_epochs, "from": origin["point"], "step": origin["step"],
                           "from_config": origin["config"], "config": values})
    elif pauses and storage is not None:  # a first start: what a crashed earlier run left is not this trial's
        trial_checkpoint.clear(storage)
    latest = storage.latest() if storage is not None else None  # the one listing before the first step
    resume = latest is not None
    previous = Folder(job.output_where, "output.dir").read_json("result.json") if resume else None
    report = TuneReport(job, pid, values, storage, pauses, done_epochs, scheduler)
    try:
        run.execute(job, resume=resume, display=ProgressDisplay(quiet=True), previous=previous, latest=latest,
                    callbacks=[report], tracking_parent=tracking_parent,
                    placement_group=ray.util.get_current_placement_group(), code=code,
                    keep_processes=reuse)
        report.report_held()
    except BaseException:  # the job's workers, kept when it succeeded, are not for the next trial now
        if reuse:
            from raytf.driver.ray_group import drop_kept

            drop_kept()
        raise


def _add_restore(job: Job, entry: dict[str, Any]) -> None:
    folder = Folder(job.output_where, "output.dir")
    folder.write_json(RESTORES, [*(folder.read_json(RESTORES) or []), entry])
