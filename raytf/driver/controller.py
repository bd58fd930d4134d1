"""One job as a state machine: placing -> starting -> running -> (restarting -> placing ...) -> done | failed.

`Controller.step()` advances one state (while running: one poll of the tasks). What to do is decided by
the policies (raytf.driver.policy: restarts, elastic sizes, replacements, hangs, every number in `Limits`); how
is the `Resources` and `WorkerGroup` interfaces (raytf.driver.group; Ray's implementation in raytf.driver.ray_group,
an in-memory one in tests/fakes.py) and an injected clock, so a unit test can step a job without Ray or TensorFlow. What
differs between strategies is asked of the job's backend (raytf.backends); node drains are watched by
raytf.driver.drain; what result.json says is raytf.driver.result_record. The controller owns every actor and
placement group it creates and frees them on every path out (success, failure, Ctrl-C).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

from raytf import backends
from raytf.checkpoint import UNLISTED, Storage
from raytf.driver import hangs
from raytf.driver import result_record, task_failure
from raytf.driver.attempt import Attempt, EpochFeed, Rate, Replacement, build_payload
from raytf.driver.callbacks import Callback
from raytf.driver.drain import DrainWatch
from raytf.driver.failure import Failure
from raytf.driver.group import Finished, Resources, TaskError, WorkerGroup
from raytf.driver.packaging import pack_code
from raytf.driver.policy import (Heard, Limits, ReplacementPolicy, RestartPolicy, ScalingPolicy, elastic_batch, heard,
                                 hung_ranks, spec_for_workers)
from raytf.driver.report import ProgressDisplay, Result
from raytf.errors import PlacementTimeout, PortTaken, TrainingFailed, WorkerStartupError
from raytf.job import Job
from raytf.protocol import Outcome, TaskCode
from raytf.rendezvous import Task

PLACING, STARTING, RUNNING, RESTARTING, DONE, FAILED = "placing", "starting", "running", "restarting", "done", "failed"


class WallClock:
    """Seconds since the epoch; tests step the controller with a fake one."""

    @staticmethod
    def now() -> float:
        return time.time()


class Controller:
    """`callbacks` watch the run (raytf.driver.callbacks): each state entered, each epoch. `first_checkpoint`:
    the checkpoint a resumed run starts from, when the caller has listed checkpoint.dir already (the folder
    is then listed again only for a restart)."""

    def __init__(self, job: Job, resources: Resources, *, code: TaskCode | None, limits: Limits = Limits(),
                 clock=WallClock, display: ProgressDisplay | None = None, resume: bool = False,
                 callbacks: Sequence[Callback] = (), placement_group=None,
                 attempts: list[dict[str, Any]] | None = None, first_checkpoint=UNLISTED):
        self.job, self.spec = job, job.spec
        self.callbacks = list(callbacks)
        self.backend = backends.get(self.spec.strategy)
        self.resources, self.code, self.limits, self.clock = resources, code, limits, clock  # code: None with fakes
        self.display = display or ProgressDisplay(quiet=True)
        self.epochs = EpochFeed(self.display, self.callbacks)
        self.resume = resume
        self.first_checkpoint = first_checkpoint
        self.given_pg, self.pg = placement_group, placement_group
        self.restart_policy = RestartPolicy(self.spec.failure.max_restarts)
        self.scaling = ScalingPolicy(self.spec, limits, self.backend.supports_elastic)
        self.storage = None if job.checkpoint_dir is None else Storage(job.checkpoint_dir)
        self.base_payload = build_payload(job)
        self.bad_checkpoints: set[str] = set()
        self.started = clock.now()
        self.result = Result(name=self.spec.name, strategy=self.spec.strategy, status="failed",
                             output_dir=job.output_where, attempts=list(attempts or []))
        self.decisions: list[dict[str, Any]] = []  # one per failed attempt: what happened, what was done
        self.worker_losses: list[dict[str, Any]] = []
        self.state = PLACING
        self.attempt: Attempt | None = None
        self.failure: tuple[Failure, list[str]] | None = None
        self.error: BaseException | None = None
        self._phase_started = self.started
        self._rate = Rate()
        self._checkpoint_s: float | None = None  # how long the last checkpoint-now took

    # ---------------------------------------------------------------- driving

    def run(self) -> Result:
        try:
            while self.state not in (DONE, FAILED):
                self.step()
            if self.state == FAILED:
                raise self.error
            self._keep_or_stop_group()
        except BaseException as exc:  # result.json first: a sweep's stopped trial may be killed during the teardown
            self._record_failure(exc)
            self._write()
            self._stop_group()
            raise
        finally:
            self.resources.release_standby()
            if self.pg is not None and self.given_pg is None:
                self.resources.release(self.pg)
                self.pg = None
        return self.result

    def step(self) -> str:
        """Advance one state; returns the new one."""
        {PLACING: self._place, STARTING: self._start, RUNNING: self._supervise, RESTARTING: self._decide}[self.state]()
        for callback in self.callbacks:
            callback.on_state(self.state)
        return self.state

    # ---------------------------------------------------------------- states

    def _place(self) -> None:
        """The placement group for the next attempt: the caller's, the one held since the last attempt
        (the resources are never let go, and Ray moves bundles off a dead node by itself), or a new one."""
        spec, backend = self.spec, self.backend
        self._phase_started = self.clock.now()
        workers = spec.cluster.workers
        if self.given_pg is None:
            waited = False
            if self.pg is not None and self.decisions and self.decisions[-1]["kind"] in ("preempted", "resized"):
                # a bundle of it is on the draining node, which Ray will not schedule on again; or it is too small
                self.resources.release(self.pg)
                self.pg, waited = None, self.decisions[-1]["kind"] == "resized"  # room just seen: a short wait
            if self.pg is not None and not self.resources.ready_again(self.pg, spec.cluster.reserve_timeout_s):
                self.display.message("raytf: the placement group did not come back in time; reserving anew")
                self.resources.release(self.pg)
                self.pg, waited = None, True
            if self.pg is None:
                self.pg, workers = self._reserve(full_size_waited=waited)
            else:
                workers = self.attempt.spec.cluster.workers
        attempt_spec = spec_for_workers(spec, workers)
        if self.decisions or self.first_checkpoint is UNLISTED:
            resume_from = (self.storage.latest(exclude=self.bad_checkpoints)
                           if self.storage and (self.resume or self.decisions) else None)
        else:  # the first attempt: from the caller's listing
            resume_from = self.first_checkpoint if self.resume else None
        payload = dataclasses.replace(self.base_payload, spec=attempt_spec, resume_from=resume_from)
        self.attempt = Attempt(attempt_spec, payload, backend.bundles(attempt_spec),
                                replacements=ReplacementPolicy(attempt_spec.cluster.workers, self.limits),
                                drains=DrainWatch(spec, backend, self.resources, self.limits, self.display,
                                                  can_save=self.storage is not None,
                                                  last_checkpoint_s=self._checkpoint_s, workers=workers,
                                                  decisions=self.decisions))
        self.result.workers = attempt_spec.cluster.workers
        self.result.batch = elastic_batch(spec, workers).to_dict()
        if self.decisions:
            resumed = resume_from.step if resume_from else 0
            last = self.decisions[-1].get("last_step")
            self.decisions[-1].update(resumed_from_step=resumed, workers=workers, batch=self.result.batch,
                                      steps_lost=max(0, last - resumed) if last is not None else None)
        self._phase("reserve_s")
        self.state = STARTING

    def _reserve(self, full_size_waited: bool = False) -> tuple[Any, int]:
        sizes = self.scaling.sizes(after_failure=bool(self.decisions), full_size_waited=full_size_waited)
        note = self.backend.reservation_note(self.spec)
        placement = self.spec.cluster.effective_placement
        for i, (workers, timeout_s) in enumerate(sizes):
            bundles = self.backend.bundles(spec_for_workers(self.spec, workers))
            self.display.message(f"raytf: reserving {len(bundles)} x {bundles[-1]} " + (f"({note}) " if note else "")
                                 + f"({placement})")
            try:
                return self.resources.reserve(bundles, placement, timeout_s,
                                              name=f"raytf-{self.spec.name}-{os.getpid()}"), workers
            except PlacementTimeout:
                if i == len(sizes) - 1:
                    raise
                self.display.message(f"raytf: {workers} workers not available; trying {sizes[i + 1][0]} "
                                     f"(failure.elastic)")
        raise AssertionError("unreachable")

    def _start(self) -> None:
        """One rendezvous: actors report in, ranks are assigned, TensorFlow starts; a port lost meanwhile
        costs a fresh rendezvous (up to Limits.rendezvous_attempts)."""
        a, timeout_s = self.attempt, self.spec.cluster.start_timeout_s
        a.rendezvous_tries += 1
        kept = self._take_kept() if a.rendezvous_tries == 1 else None
        if kept is not None and not self._set_up_kept(kept, timeout_s):
            a.rendezvous_tries -= 1  # the next try is this job's own first rendezvous
            return
        if kept is None and not self._set_up_new(timeout_s):
            return
        self.result.rendezvous_attempts = a.rendezvous_tries
        if kept is not None:
            self.result.processes_reused = len(a.tasks)
        self._phase("start_s")
        self.display.message("raytf: " + ", ".join(
            f"rank {t.rank}@{t.address}" + (f" gpu {','.join(t.gpu_ids)}" if t.gpu_ids else "") for t in a.tasks)
            + (" (the previous trial's processes)" if kept is not None else ""))
        handles = a.group.train(a.payload)
        now = self.clock.now()
        for task, handle in zip(a.tasks, handles):
            a.task_of[handle] = task
            supervision = self.backend.supervision[task.role]
            (a.awaited if supervision.awaited else a.side).append(handle)
            if supervision.watched:
                a.progress_seen[task.rank] = Heard(None, now)
        if not self.decisions:  # a sweep's kept group (no rendezvous of its own)
            self._arm_standby()
        self.state = RUNNING

    def _set_up_new(self, timeout_s: float) -> bool:
        """New actors (or warm standbys) report in, get ranks, start TensorFlow; False: the attempt failed,
        or a port was lost and a fresh rendezvous follows."""
        a = self.attempt
        warm = {}
        if a.rendezvous_tries == 1:
            warm = self.resources.take_standby(self.pg, len(a.bundles))
            if self.decisions:
                self.decisions[-1]["standby"] = len(warm)  # warm processes promoted (0: all new)
        a.group = self.resources.new_group(self.pg, a.bundles, self.code, warm,
                                           names=lambda nodes: self.backend.actor_names(a.spec, nodes))
        try:
            a.tasks = self.backend.assign(a.group.start(timeout_s), a.spec)
            # Warm processes for a restart import TensorFlow beside the first attempt's tasks (ready for an early
            # failure); after a restart, only once it trains again (they would slow the recovery down).
            if not self.decisions:
                self._arm_standby()
            a.group.setup(a.tasks, a.payload, timeout_s)
        except PortTaken as exc:
            if a.rendezvous_tries >= self.limits.rendezvous_attempts:
                self._attempt_failed(Failure("startup", str(exc), (), {str(exc): []}))
                return False
            self._stop_group()
            self.display.message(f"raytf: {exc}; new rendezvous (attempt {a.rendezvous_tries + 1})")
            return False
        except WorkerStartupError as exc:  # actors that did not start, report in or set up in time
            self._attempt_failed(Failure("startup", str(exc), (), {str(exc): []}, traceback=exc.traceback))
            return False
        return True

    def _take_kept(self):
        """A sweep's previous trial's group, kept in this process, when this job can run in it (its first
        attempt, the same key, placement group and code); a kept group that cannot serve is let go here."""
        key = None if self.decisions else self.backend.process_key(self.attempt.spec)
        return self.resources.take_kept(self.pg, key, self.code, len(self.attempt.bundles))

    def _process_key(self) -> str | None:
        """The key this attempt's group could be kept under for a sweep's next trial (raytf.actor.reuse); None
        outside a trial's placement group, or for a strategy whose processes are not reused."""
        a = self.attempt
        if self.given_pg is None or a is None or a.group is None:
            return None
        return self.backend.process_key(a.spec)

    def _keep_or_stop_group(self) -> None:
        """After a job that ended well, and only then (a Tune report from the last epochs may still stop the
        trial): its group stays for the next trial in this process, or stops. Not one on a draining node."""
        a, key = self.attempt, self._process_key()
        if key is not None:
            draining = self.resources.draining()
            if not any(t.node_id in draining for t in a.tasks) and self.resources.keep(a.group, a.tasks, key):
                a.group = None
        self._stop_group()

    def _set_up_kept(self, kept, timeout_s: float) -> bool:
        """Set up the kept tasks for this job; False (the group stopped) when they do not start again: new
        actors take their place, at no cost to the restart budget."""
        a = self.attempt
        a.group, a.tasks = kept
        try:
            a.group.setup(a.tasks, a.payload, timeout_s)
        except (PortTaken, WorkerStartupError) as exc:
            self.display.message(f"raytf: the previous trial's processes did not start again ({exc}); "
                                 f"starting new ones")
            self._stop_group()
            a.tasks = []
            return False
        return True

    def _supervise(self) -> None:
        """One poll: collect the tasks that returned, bring back lost ones, watch for hangs, show progress."""
        a = self.attempt
        returned = a.drains.wait(a.group, a.awaited + a.side, a.tasks, self.clock)
        for i, finished in enumerate(returned):
            if self._returned(finished, returned[i + 1:]):
                return  # the attempt ended
        a.collect_replacements(self.display.message)
        if not a.awaited:
            return self._finish()
        progress = a.group.progress(self.limits.progress_timeout_s)
        now = self.clock.now()
        hang_timeout_s = self.spec.failure.hang_timeout_s
        if a.training_done_at is None:
            first_from = a.payload.resume_from.step if a.payload.resume_from else 0
            before_first = {rank for rank in a.progress_seen  # raytf's loop, still before its first step
                            if self._says_steps and progress[rank] is not None and progress[rank].global_step <= first_from}
            for rank in a.progress_seen:
                p = progress[rank]
                if p is not None and rank not in a.outcomes:
                    marker = (p.phase, p.global_step, p.work_done)
                    cpu_s = None if rank in before_first else p.cpu_s
                    a.progress_seen[rank] = heard(a.progress_seen[rank], marker, cpu_s, now, hang_timeout_s,
                                                  self.limits)
            a.last_step = max([a.last_step] + [p.global_step for p in progress if p])
            drained = a.drains.poll(a.group, a.tasks, sorted(a.progress_seen), progress, a.last_step, now)
            if drained is not None:  # the attempt ends for a draining node
                return self._attempt_failed(drained, a.drains.node_ips)
            watched = {r: seen.at for r, seen in a.progress_seen.items() if r not in a.outcomes}
            hung, message = hung_ranks(watched, before_first, now, hang_timeout_s, self.limits, self.backend.who,
                                       synchronous=self.backend.synchronous_steps and not self._says_steps)
            if hung and not set(hung) <= a.hangs_named:  # every rank's stacks, before a restart (or instead)
                a.hangs_named |= set(hung)
                self.result.hangs.append(hangs.name(a, self.backend, hung, progress, len(self.decisions) + 1,
                                                    self.job.output_dir, self.spec.failure.hang_mode, self.display.message))
            if hung and self.spec.failure.hang_mode == "restart":
                failure = Failure("hang", message, tuple(hung), {message: hung})
                if self._rescuing:  # the ranks waiting for the stalled one keep their state
                    failure = task_failure.hang_rescue(a, failure, self.clock, self.limits, self.display.message)
                return self._attempt_failed(failure, sorted({a.tasks[r].node_ip for r in hung}))
            chief = progress[0]
            if chief is not None:
                self.epochs.feed(chief.epochs)
                if not a.standby_armed and chief.global_step > 0:
                    self._arm_standby()
                self.display.update(chief, self._rate.update(chief))
        elif now - a.training_done_at > hang_timeout_s:  # only side-cars are left
            for handle in list(a.awaited):
                task = a.task_of[handle]
                self.result.evaluations_error = (f"the {task.role} did not finish within {hang_timeout_s:g}s "
                                                 f"(failure.hang_timeout_s) after training ended")
                self.display.message(f"raytf: {self.result.evaluations_error}; stopping it")
                final = progress[task.rank].evaluations if progress[task.rank] else ()
                a.outcomes[task.rank] = Outcome(evaluations=list(final))
                a.awaited.remove(handle)
            return self._finish()

    @property
    def _rescuing(self) -> bool:
        """Whether a failed attempt resumes from a survivor's state (raytf's loop, a strategy whose workers each
        hold it all, a checkpoint.dir to save it to)."""
        return self.backend.rescues_peers and self.spec.train_fn is None and self.storage is not None

    @property
    def _says_steps(self) -> bool:
        """Whether every watched rank says each optimizer step: raytf's own loop under a synchronous strategy."""
        return self.spec.train_fn is None and self.backend.synchronous_steps

    def _returned(self, finished: Finished, with_it: list[Finished]) -> bool:
        """A task's train call returned (`with_it`: the others that returned in the same poll); True when
        that ended the attempt."""
        a = self.attempt
        task = a.task_of.pop(finished.handle)
        awaited = finished.handle in a.awaited
        (a.awaited if awaited else a.side).remove(finished.handle)
        if finished.error is None:
            a.outcomes[task.rank] = finished.outcome
            if finished.outcome.preempted is not None:  # stopped for a drain notice, its checkpoint written
                if task.rank == 0:  # the chief uploads the checkpoint: once it returns, it is there
                    stop = finished.outcome.preempted
                    if stop.saved:
                        self._checkpoint_s = stop.saved.seconds  # the next notice's estimate
                    self._attempt_failed(a.drains.stopped(stop, self.clock.now()), a.drains.node_ips)
                    return True
                return False
            if all(rank in a.outcomes for rank in a.progress_seen):  # side-cars (an evaluator) may go on
                a.training_done_at = self.clock.now()
            return False
        on_failure = self.backend.supervision[task.role].on_failure
        if on_failure == "record":
            self.result.evaluations_error = finished.error.described
            self.display.message(f"raytf: the {task.role} failed ({finished.error.described}); training goes on")
            return False
        if on_failure == "replace":
            loss = {"worker": task.index, "node_ip": task.node_ip, "at": round(self.clock.now(), 3),
                    "cause": finished.error.described, "replaced": False}
            self.worker_losses.append(loss)
            self.display.message(f"raytf: {task.role} {task.index} on {task.node_ip} lost ({loss['cause']}); "
                                 f"the other {task.role}s go on")
            if a.replacements.replace(training_done=a.training_done_at is not None):
                a.replacing.append(Replacement(a.group, task, a.payload, loss))
            return False
        self._fatal(task, finished.error, with_it)
        return True

    def _fatal(self, task: Task, error: TaskError, with_it: list[Finished]) -> None:
        """The attempt ends for a task's fatal error: with its peers' errors, and a survivor's state where the
        task died (raytf.driver.task_failure)."""
        failure = task_failure.attempt_failure(self.attempt, task, error, with_it, self.backend, self.clock,
                                               self.limits, self._rescuing, self.display.message)
        self._attempt_failed(failure, sorted({self.attempt.tasks[r].node_ip for r in failure.ranks}) or [task.node_ip])

    def _attempt_failed(self, failure: Failure, nodes: list[str] | None = None) -> None:
        a = self.attempt
        if a is not None and a.drains is not None:  # during a drain notice, lost infrastructure is the node going
            seen_as = a.drains.during_notice(failure, self.clock.now())
            if seen_as is not failure:
                failure, nodes = seen_as, a.drains.node_ips
        failure.details.setdefault("last_step", a.last_step if a is not None else 0)
        if failure.kind in ("error", "checkpoint", "io"):  # the tasks answer: an exception, not a lost actor
            self._last_epochs()
        self._stop_group()
        self.failure = (failure, nodes or [])
        self.state = RESTARTING

    def _decide(self) -> None:
        failure, nodes = self.failure
        decision = self.restart_policy.decide(failure, self.restart_policy.charged(self.decisions))
        if decision.action == "raise":
            self.error = TrainingFailed(f"training failed: {failure.message}"
                                        + (f" ({decision.reason})" if self.decisions else ""), failure.causes,
                                        failure.traceback, failure.per_rank)
            self.state = FAILED
            return
        resumed = self.attempt.payload.resume_from
        if failure.kind == "checkpoint" and resumed is not None:
            self.bad_checkpoints.add(resumed.path)
        self.decisions.append(result_record.restart(failure, nodes, self.clock.now(), decision.charged))
        self.display.message(f"raytf: attempt failed: {failure.message}; {decision.reason}")
        self.state = PLACING

    def _finish(self) -> None:
        a = self.attempt
        if self._process_key() is None:  # otherwise decided once the job has ended well (_keep_or_stop_group)
            self._stop_group()
        self._phase("train_s")
        spec, result = self.spec, self.result
        chief = a.outcomes[0]
        if self.decisions:  # when training was back on its feet after the last failure
            self.decisions[-1]["first_step_at"] = chief.first_step_at
        self.epochs.feed(chief.history)  # the epochs that ended after the last poll
        result_record.succeeded(result, self.job, self.backend, a.tasks, a.outcomes, self.worker_losses,
                                self.started)
        self._write()
        for line in result_record.summary(spec, result, self.backend.synchronous_steps):
            self.display.message(line)
        self.state = DONE

    # ---------------------------------------------------------------- helpers

    def _record_failure(self, exc: BaseException) -> None:
        result_record.failed(self.result, exc, self.epochs.history, self.backend,
                             self.attempt.tasks if self.attempt is not None else [], self.attempt)

    def _arm_standby(self) -> None:
        a = self.attempt
        if a.standby_armed:
            return
        a.standby_armed = True
        if self.backend.supports_standby and self.restart_policy.restarts_left(self.decisions) > 0:  # else unused
            self.resources.fill_standby(self.pg, self.code, a.tasks, self.spec.name)

    def _last_epochs(self) -> None:
        """The epochs the chief finished since the last poll (a train_fn may report one and fail at once)."""
        a = self.attempt
        if a is None or a.group is None or not a.tasks:
            return
        try:
            chief = a.group.progress(self.limits.progress_timeout_s)[0]
        except Exception:  # the group is going down; what was seen is kept
            return
        if chief is not None:
            self.epochs.feed(chief.epochs)

    def _stop_group(self) -> None:
        if self.attempt is not None and self.attempt.group is not None:
            self.attempt.group.stop()
            self.attempt.group = None

    def _phase(self, name: str) -> None:
        now = self.clock.now()
        self.result.phases[name] = round(now - self._phase_started, 3)
        self._phase_started = now

    def _write(self) -> None:
        result_record.close(self.result, self.decisions, self.worker_losses, self.clock.now() - self.started)
        self.result.write(self.job.output_dir)


def start(job: Job, group_cls: Callable[..., WorkerGroup] | None = None,
          display: ProgressDisplay | None = None, resume: bool = False, callbacks: Sequence[Callback] = (),
          placement_group=None, code: TaskCode | None = None, verbose: bool = False,
          resources: Resources | None = None, clock=WallClock, limits: Limits = Limits(),
          attempts: list[dict[str, Any]] | None = None, keep_processes: bool = False,
          first_checkpoint=UNLISTED) -> Controller:
    """The job's controller, its code packed (or `code`: a sweep's, packed once by its driver), ready to
    `run()`. `placement_group`: a group someone else reserved (a Tune trial's), one bundle per task from index
    0, never removed here. `resources`, `clock`, `limits`: seams for tests (by default Ray's, `group_cls` the
    actors' group class). `attempts`: the run's starts, this one last. `keep_processes`: a sweep's trial keeps
    a succeeded job's actors for its next trial (raytf.actor.reuse). The lifecycle around it: raytf.driver.run."""
    spec = job.spec
    if resources is None:
        from raytf.driver.ray_group import RayResources, RayWorkerGroup

        standby = spec.failure.standby and spec.failure.max_restarts > 0
        resources = RayResources(group_cls or RayWorkerGroup, standby_enabled=standby,
                                 standby_check_s=limits.standby_check_s, keep_processes=keep_processes)
    if code is None:
        code = pack_code(job, verbose=verbose, note=display.message if display else None)
    return Controller(job, resources, code=code, limits=limits, clock=clock, display=display, resume=resume,
                      callbacks=callbacks, placement_group=placement_group, attempts=attempts,
                      first_checkpoint=first_checkpoint)


def run(job: Job, **options: Any) -> Result:
    """`start(job, **options).run()`: the controller alone, for tests and benchmarks that drive one directly."""
    return start(job, **options).run()
