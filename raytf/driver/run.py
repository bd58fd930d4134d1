"""One run of a job, whatever starts it: `raytf run` and `raytf.fit`, a submitted job (its driver runs
`raytf run` on the cluster) and each trial of a sweep (raytf.sweep_trial). A trial differs only in its
callbacks (Tune's report) and its placement group.

    execute
      checkpoint.dir listed once: the resume rules, and the checkpoint the first attempt starts from
      output.dir claimed (a lock, earlier results moved aside; a private staging folder for a URI)
      result.json written "running" from the start, with this attempt (raytf.driver.attempts)
      the callbacks (raytf.driver.callbacks): Prometheus series, MLflow run, the caller's own
      the controller: attempts until one succeeds or the restart policy gives up
      closed whatever ends it (success, failure, Ctrl-C, SIGTERM, a scheduler's stop): result.json is never
      left "running", every callback hears the end, the staged files are shipped (raytf.driver.output)
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Sequence

from raytf.checkpoint import UNLISTED, Storage, resume_note
from raytf.driver import attempts as attempts_lib
from raytf.driver import callbacks as callbacks_lib
from raytf.driver import controller, output
from raytf.driver.callbacks import Callback, end_reason, end_state
from raytf.driver.report import ProgressDisplay, Result
from raytf.job import Job
from raytf.protocol import TaskCode
from raytf.storage import Folder


def execute(job: Job, *, resume: "bool | str", display: ProgressDisplay, previous: dict[str, Any] | None = None,
            lease=None, session=None, latest=UNLISTED, callbacks: Sequence[Callback] = (),
            tracking_parent: str | None = None, placement_group=None, code: TaskCode | None = None,
            keep_processes: bool = False, verbose: bool = False, group_cls=None) -> Result:
    """Run `job` to its end and return its Result (raising what ended it otherwise).

    `resume`: the spec's (True, "auto" or False). `previous`: the run's earlier result.json, whose attempts
    this one continues. `lease`: output.dir on object storage, held by this driver (raytf.driver.lease).
    `session`: a context manager entered once output.dir is claimed (raytf.driver.session.ray_session for a
    driver that starts or joins Ray; none inside a sweep's trial), which may yield a line to show. `latest`:
    the newest checkpoint, when the caller listed checkpoint.dir already. `callbacks`: the caller's own, after
    the spec's (tracking_parent: the sweep's MLflow run, which a trial's run nests in). The rest as
    raytf.driver.controller.start (`group_cls`: the actors' group class, a test's fault-injecting one)."""
    if latest is UNLISTED:
        latest = Storage(job.checkpoint_dir).latest() if job.checkpoint_dir is not None else None
    note = resume_note(job.checkpoint_dir, resume, latest)  # --resume and checkpoint.dir agree, before anything
    if note:
        display.message(note)
    first = latest if resume else None
    with output.claim(job, bool(resume), lease) as job, (session or contextlib.nullcontext()) as said:
        if said:
            display.message(said)
        from raytf.driver.session import cluster_identity

        tries = attempts_lib.carried(previous, job.spec.name)
        tries.append(attempts_lib.begin(len(tries) + 1, cluster_identity(), first.step if first else None))
        # The run's state is in its storage from its start: a driver that never gets to write its end
        # (killed, its cluster gone) leaves "running" behind, and the next attempt says it was lost.
        running = Result(name=job.spec.name, strategy=job.spec.strategy, status="running",
                         output_dir=job.output_where, attempts=tries, history=list(first.history) if first else [])
        Folder(job.output_where, "output.dir").write_bytes("result.json", running.json_text().encode())
        watchers = [*callbacks_lib.for_job(job, display.message, tracking_parent), *callbacks]
        ran, error = None, None
        try:
            ran = controller.start(job, display=display, resume=bool(resume), callbacks=watchers,
                                   placement_group=placement_group, code=code, verbose=verbose,
                                   attempts=tries, keep_processes=keep_processes, first_checkpoint=first,
                                   group_cls=group_cls)
            return ran.run()
        except BaseException as exc:
            error = exc
            close_unfinished(job, running, exc)
            raise
        finally:
            callbacks_lib.end_all(watchers, ran.result if ran is not None else None, error)


def close_unfinished(job: Job, running: Result, exc: BaseException) -> None:
    """A run that ended before its controller wrote result.json (the job folder's upload, a controller that
    never started) ends failed, interrupted or stopped, not "running" (which the next attempt would call lost)."""
    staged = job.output_dir / "result.json"  # output.dir, or the staging folder shipped up to it
    try:
        written = json.loads(staged.read_text()).get("status") != "running"
    except (OSError, ValueError):
        written = False
    if written:
        return
    running.status, running.error = end_state(exc), end_reason(exc)
    attempts_lib.end(running.attempts[-1], running.status, running.error)
    running.write(job.output_dir)
