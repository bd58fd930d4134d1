"""Node drains (preemption) and growing back, for one attempt: both end it with every loop-running rank stopped
at one common step and checkpointed there, and the attempt ends once the chief has (or falls back to the last
checkpoint when that cannot be had in time).

A drain: raytf asks Ray's GCS which nodes are draining (`ray drain-node`, the autoscaler, a cloud's preemption
notice); the first notice for a node whose loss ends the attempt stops it. Growing back (failure.elastic): while
the attempt runs below cluster.workers, every elastic.grow_check_s raytf asks Ray whether the missing workers'
bundles can be placed (a probe placement group, removed at once); once they can, the attempt stops and the job
restarts at the full size ("resized").

The controller calls `poll` once per supervision round, `stopped` when the chief returns stopped for the
notice, and `during_notice` for any other failure of the attempt. What the numbers decide (the stop step,
whether a checkpoint fits before the deadline) is raytf.driver.policy's.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from raytf.driver import failure as failure_lib
from raytf.driver.failure import Failure
from raytf.driver.policy import Limits, checkpoint_fits, spec_for_workers, stop_step

GROW_PROBE_S = 1.0  # how long a probe for the missing workers' bundles may wait (the supervision loop waits with it)

if TYPE_CHECKING:
    from raytf.backends.base import Backend
    from raytf.driver.group import Resources, WorkerGroup
    from raytf.driver.report import ProgressDisplay
    from raytf.protocol import DrainStop, Progress
    from raytf.rendezvous import Task
    from raytf.spec import JobSpec


@dataclasses.dataclass
class DrainNotice:
    """A node of the attempt is draining: when raytf saw it, its deadline, and the step every loop-running
    rank was asked to stop and checkpoint at (None: none asked, the attempt goes on until the node goes)."""

    node_id: str
    node_ip: str
    ranks: list[int]  # the tasks on that node
    seen_at: float
    deadline: float | None  # epoch seconds; None: no deadline given
    step_at_notice: int = 0  # the furthest rank's step when raytf saw the notice
    stop_step: int | None = None
    grow_to: int | None = None  # not a drain: room for this many workers again (failure.elastic)

    def details(self, now: float, saved_step: int | None) -> dict[str, Any]:
        """result.json's restart entry for it (kept as it was: users read these keys)."""
        left = None if self.deadline is None else round(self.deadline - self.seen_at, 3)
        return {"node_id": self.node_id, "node_ip": self.node_ip, "deadline": self.deadline,
                "deadline_s_after_notice": left, "step_at_notice": self.step_at_notice, "stop_step": self.stop_step,
                "step_saved": saved_step,
                "notice_to_checkpoint_s": round(now - self.seen_at, 3) if saved_step is not None else None}


class DrainWatch:
    """One attempt's watch on its nodes. `can_save`: the job has a checkpoint.dir to checkpoint into;
    `last_checkpoint_s`: how long the last checkpoint-now took (an earlier attempt's), if any."""

    def __init__(self, spec: "JobSpec", backend: "Backend", resources: "Resources", limits: Limits,
                 display: "ProgressDisplay", can_save: bool, last_checkpoint_s: float | None = None,
                 workers: int | None = None, decisions: list[dict[str, Any]] = ()):
        """workers: the attempt's (below cluster.workers under failure.elastic: it may grow back); decisions: the
        run's restart records so far."""
        self.spec, self.backend, self.resources, self.limits, self.display = spec, backend, resources, limits, display
        self.can_save, self.last_checkpoint_s = can_save, last_checkpoint_s
        self.workers = spec.cluster.workers if workers is None else workers
        self.decisions = decisions
        self.notice: DrainNotice | None = None
        self._checked_at = 0.0
        self._grow_checked_at: float | None = None
        self._let_go: set[str] = set()  # draining nodes whose loss the job survives

    def poll(self, group: "WorkerGroup", tasks: "list[Task]", loop_ranks: list[int],
             progress: "list[Progress | None]", last_step: int, now: float) -> Failure | None:
        """Ask Ray's GCS (every Limits.drain_check_s) whether a node of this attempt is draining; on the first
        such notice, have every loop-running rank stop at one common step and checkpoint there. While that
        goes on, give up on it once the deadline (or Limits.preempt_wait_s) has passed. A Failure: end the
        attempt with it (on the notice's node)."""
        notice = self.notice
        if notice is not None:
            limit = notice.deadline if notice.deadline is not None else notice.seen_at + self.limits.preempt_wait_s
            if notice.stop_step is not None and now > limit:
                return self._fall_back(f"the checkpoint at step {notice.stop_step} did not finish before "
                                       + ("the node's deadline" if notice.deadline is not None else
                                          f"{self.limits.preempt_wait_s:g}s (Limits.preempt_wait_s)"), now)
            return None
        if not self.spec.failure.preemption or now - self._checked_at < self.limits.drain_check_s:
            return self._grow(group, loop_ranks, progress, last_step, now)
        self._checked_at = now
        draining = self.resources.draining()
        on_drained = self._on_drained(tasks, draining)
        # A node holding only tasks the job goes on without (parameter-server workers, replaced; an
        # evaluator, recorded) is let go: no checkpoint-now, no restart; its tasks are dealt with when it goes.
        fatal = [t for t in on_drained if self.backend.supervision[t.role].on_failure == "fatal"]
        for node in sorted({t.node_id for t in on_drained} - {t.node_id for t in fatal}):
            self._let_go.add(node)
            let_go = [t for t in on_drained if t.node_id == node]
            self.display.message(f"raytf: node {let_go[0].node_ip} ({self.backend.who([t.rank for t in let_go])}) "
                                 f"is draining; training goes on without it")
        if not fatal:
            return self._grow(group, loop_ranks, progress, last_step, now)
        node = fatal[0].node_id
        self.notice = notice = DrainNotice(node, on_drained[0].node_ip, [t.rank for t in tasks if t.node_id == node],
                                           now, draining[node], last_step)
        when = "no deadline" if notice.deadline is None else f"deadline in {notice.deadline - now:.0f}s"
        said = f"raytf: node {notice.node_ip} ({self.backend.who(notice.ranks)}) is draining ({when})"
        if not self.can_save:
            self.display.message(f"{said}; there is no checkpoint.dir to save to, so training goes on until the "
                                 f"node goes")
            return None
        return self._stop_everyone(group, loop_ranks, progress, now, said)

    def wait(self, group: "WorkerGroup", handles: list, tasks: "list[Task]", clock) -> list:
        """Up to one poll interval for tasks to return; meanwhile Ray's GCS is asked for drains every
        drain_check_s, so that a preemption notice is acted on within that rather than a whole poll later."""
        deadline = clock.now() + self.limits.poll_interval_s
        while True:
            left = deadline - clock.now()
            returned = group.wait(handles, max(0.0, min(left, self.limits.drain_check_s)))
            if returned or left <= self.limits.drain_check_s or self.drain_seen(tasks):
                return returned

    def drain_seen(self, tasks: "list[Task]") -> bool:
        """Between polls (the controller asks every Limits.drain_check_s while it waits for its tasks): whether a
        node of these tasks has begun to drain, unanswered yet. If so the next poll acts on it at once."""
        if not self.spec.failure.preemption or self.notice is not None:
            return False
        if not self._on_drained(tasks, self.resources.draining()):
            return False
        self._checked_at = float("-inf")
        return True

    def _on_drained(self, tasks: "list[Task]", draining: dict[str, float | None]) -> "list[Task]":
        return [t for t in tasks if t.node_id in draining and t.node_id not in self._let_go]

    def _grow(self, group: "WorkerGroup", loop_ranks: list[int], progress: "list[Progress | None]", last_step: int,
              now: float) -> Failure | None:
        """Below cluster.workers under failure.elastic: every grow_check_s, whether the missing workers fit
        again; when they do, stop everyone at one step to restart at the full size from there."""
        spec, full = self.spec, self.spec.cluster.workers
        elastic = spec.failure.elastic
        if (elastic is None or not elastic.grow_check_s or self.workers >= full or not self.can_save
                or not self.backend.supports_elastic or spec.cluster.effective_placement.startswith("strict")):
            return None  # (a strict placement's full group is not the missing bundles placed apart: no probe)
        chief = progress[0] if progress else None
        if chief is None or chief.checkpoint_s is None:  # nothing saved in this attempt yet: a train_fn may never
            return None
        if self._grow_checked_at is None:  # the attempt's first poll: its first check one interval on
            self._grow_checked_at = now
        # each grow that ended below the full size again (the room went meanwhile) doubles the interval
        failed = sum(1 for d in self.decisions if d["kind"] == "resized" and d.get("workers", full) < full)
        if now - self._grow_checked_at < elastic.grow_check_s * 2 ** failed:
            return None
        self._grow_checked_at = now
        held = len(self.backend.bundles(spec_for_workers(spec, self.workers)))
        missing = self.backend.bundles(spec)[held:]
        if not self.resources.can_place(missing, spec.cluster.effective_placement, GROW_PROBE_S):
            return None
        self.notice = DrainNotice("", "", [], now, None, last_step, grow_to=full)
        said = f"raytf: {full - self.workers} more worker(s) fit again (failure.elastic)"
        return self._stop_everyone(group, loop_ranks, progress, now, said)

    def _stop_everyone(self, group: "WorkerGroup", loop_ranks: list[int], progress: "list[Progress | None]",
                       now: float, said: str) -> Failure | None:
        """Ask every loop-running rank to stop at one step the slowest can reach with time to checkpoint."""
        notice = self.notice
        checkpoint_s = max([p.checkpoint_s or 0.0 for p in progress if p] + [self.last_checkpoint_s or 0.0]) or None
        seconds_left = None if notice.deadline is None else notice.deadline - now
        answered = [progress[r] for r in loop_ranks if progress[r] is not None]
        rates = [p.steps_per_s for p in answered if p.steps_per_s]
        steps = [p.global_step for p in answered]
        per_epoch = next((p.steps for p in answered if p.steps), None)
        target = stop_step(steps, max(rates, default=None), self.limits.preempt_margin_s, per_epoch)
        # the slowest rank's way to the stop step, at the slowest rate (no rate yet: the margin)
        to_stop_s = (target - min(steps, default=0)) / min(rates) if rates else self.limits.preempt_margin_s
        if not checkpoint_fits(seconds_left, checkpoint_s, to_stop_s):
            return self._fall_back(f"{seconds_left:.1f}s left is too short for a checkpoint (the last took "
                                   f"{checkpoint_s:.1f}s)", now, said)
        answers = group.stop_at(loop_ranks, target, self.limits.progress_timeout_s)
        refused = [r for r, answer in zip(loop_ranks, answers) if not (answer and answer.accepted)]
        if refused:
            return self._fall_back(f"{self.backend.who(refused)} could not stop at step {target} (already past it, "
                                   f"or no answer)", now, said)
        notice.stop_step = target
        self.display.message(f"{said}: every worker stops at step {target} and checkpoints there")
        return None

    def stopped(self, stop: "DrainStop", now: float) -> Failure:
        """The chief stopped for the notice (its checkpoint written, if it could be): how the attempt ends."""
        notice, saved = self.notice, stop.saved
        step = saved.step if saved else None
        if notice.grow_to is not None:
            message = self._growing + (f"checkpoint at step {step}" if saved else
                                       "no checkpoint could be written (the train_fn made none)")
            return Failure("resized", message, (), {message: []},
                           {**self._grow_details(now, step), "last_step": stop.step,
                            "checkpoint_s": saved.seconds if saved else None})
        message = (f"node {notice.node_ip} is draining: " + (f"checkpoint at step {step}" if saved else
                                                             "no checkpoint could be written (the train_fn made none)"))
        details = {**notice.details(now, step), "last_step": stop.step,
                   "checkpoint_s": saved.seconds if saved else None,
                   "request_to_step_s": stop.request_to_step_s}  # the chief's, to the stop step
        return Failure("preempted", message, tuple(notice.ranks), {message: notice.ranks}, details)

    def during_notice(self, failure: Failure, now: float) -> Failure:
        """Another failure of the attempt. Infrastructure trouble during a notice is the drained node going
        before its checkpoint: a preemption. An error in the user's code is not, and ends the job as it would
        without the notice."""
        notice = self.notice
        if notice is None or notice.grow_to is not None or failure.kind not in failure_lib.RESTARTABLE:
            return failure
        rescued = failure.details.get("state_from")  # a survivor kept the state (raytf.driver.rescue)
        message = (f"node {notice.node_ip} was draining and {failure.message}; the checkpoint-now did not finish, so "
                   + (f"the job resumes from {rescued}'s state at step {failure.details['last_step']}" if rescued
                      else "the job goes back to its last checkpoint"))
        kept = {k: failure.details[k] for k in ("state_from", "last_step") if rescued}
        return Failure("preempted", message, tuple(notice.ranks), {message: notice.ranks},
                       {**notice.details(now, failure.details["last_step"] if rescued else None),
                        "cause": failure.message, **kept})

    @property
    def node_ips(self) -> list[str]:
        """The node a drain failure is charged to (none for growing back)."""
        return [self.notice.node_ip] if self.notice is not None and self.notice.grow_to is None else []

    def _fall_back(self, why: str, now: float, said: str | None = None) -> Failure:
        """A notice whose checkpoint-now cannot be had: end the attempt now, back to the last checkpoint."""
        notice = self.notice
        if said:
            self.display.message(f"{said}: {why}; going back to the last checkpoint")
        if notice.grow_to is not None:
            message = self._growing + why
            return Failure("resized", message, (), {message: []}, self._grow_details(now, None))
        message = f"node {notice.node_ip} is draining: {why}"
        return Failure("preempted", message, tuple(notice.ranks), {message: notice.ranks}, notice.details(now, None))

    @property
    def _growing(self) -> str:
        return f"growing back from {self.workers} to {self.notice.grow_to} workers: "

    def _grow_details(self, now: float, saved_step: int | None) -> dict[str, Any]:
        """result.json's restart entry for growing back."""
        notice = self.notice
        return {"from_workers": self.workers, "to_workers": notice.grow_to, "step_at_notice": notice.step_at_notice,
                "stop_step": notice.stop_step, "step_saved": saved_step,
                "notice_to_checkpoint_s": round(now - notice.seen_at, 3) if saved_step is not None else None}
