"""The controller's decisions, apart from its mechanism: pure functions and objects that take what happened
and return what to do. Every number the controller acts on is named in `Limits`. No Ray, no TensorFlow.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Literal

from raytf.driver import failure as failure_lib
from raytf.driver.failure import Failure

if TYPE_CHECKING:
    from raytf.spec import JobSpec


@dataclasses.dataclass(frozen=True)
class Limits:
    """How long the controller waits, and how often it tries again. The job's own limits
    (reserve_timeout_s, start_timeout_s, hang_timeout_s, max_restarts) come from its spec."""

    poll_interval_s: float = 1.0  # one supervision step: wait this long for a task to finish
    progress_timeout_s: float = 4.0  # how long a progress query may take before that rank counts as silent
    peer_error_grace_s: float = 2.0  # after a rank fails, how long to collect the others' errors
    rescue_wait_s: float = 5.0  # after a task died: how long its survivors may take to fail and keep their state
    rescue_answer_s: float = 2.0  # how long a survivor may take to say which step it holds (no TensorFlow)
    rescue_upload_s: float = 120.0  # how long the furthest survivor's upload of that state may take
    hang_release_s: float = 2.0  # after a hang: how long the ranks whose collectives were failed may take to let go
    rendezvous_attempts: int = 3  # fresh ports each time; a port lost twice in a row is already rare
    elastic_reserve_timeout_s: float = 10.0  # after the full size did not fit: how long each smaller size may take
    replacements_per_worker: int = 2  # parameter servers: new actors for dead workers, per worker, per attempt
    standby_check_s: float = 1.0  # how long a warm standby may take to answer before it is let go
    drain_check_s: float = 0.25  # how often Ray's GCS is asked which nodes are draining (~1 ms a question)
    preempt_margin_s: float = 0.5  # training time allowed for a "stop at step S" to reach every worker
    preempt_wait_s: float = 120.0  # a drain without a deadline: how long the checkpoint-now may take
    # A rank that reports no step (a train_fn's tf.keras fit, a long custom-loop epoch) is alive while its
    # process computes: at least this share of one core over a window (at most half of hang_timeout_s).
    # Training uses most of its cores; a task stuck in a collective or asleep uses ~0.01 (measured).
    busy_cpu_share: float = 0.1
    busy_window_s: float = 5.0
    # raytf's own loop says every step: before its first one CPU use is no sign of life (a preprocess that never
    # returns computes too), and the first step (its trace, its compilation) may take this long, or
    # hang_timeout_s where that is longer.
    first_step_s: float = 60.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do after an attempt failed: restart (resuming from the latest checkpoint that is not bad)
    or raise. `charged`: whether it counts against failure.max_restarts."""

    action: Literal["restart", "raise"]
    reason: str
    charged: bool = True


class RestartPolicy:
    """Restarts for infrastructure trouble (a dead actor or node, a hang, a broken collective, an I/O
    error, a start-up failure), up to failure.max_restarts; a corrupt checkpoint falls back to the one
    before it, free of charge; an error in the job's own code is raised at once (a restart would repeat it)."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts

    @staticmethod
    def charged(decisions: list[dict]) -> int:
        """The restarts counted against failure.max_restarts in `decisions` (the run's restart records so far)."""
        return sum(1 for d in decisions if d["charged"])

    def restarts_left(self, decisions: list[dict]) -> int:
        return self.max_restarts - self.charged(decisions)

    def decide(self, failure: Failure, charged_so_far: int) -> Decision:
        if failure.kind == "checkpoint":  # not the workers' fault
            return Decision("restart", "falling back to the previous checkpoint", charged=False)
        if failure.kind == "preempted":  # nor is a node taken away
            return Decision("restart", "a preemption is not counted against failure.max_restarts", charged=False)
        if failure.kind == "resized":  # nor is growing back
            return Decision("restart", "growing back is not counted against failure.max_restarts", charged=False)
        if failure.kind not in failure_lib.RESTARTABLE:
            return Decision("raise", f"{failure.kind} in the job's own code: a restart would repeat it")
        if charged_so_far >= self.max_restarts:
            return Decision("raise", f"failure.max_restarts ({self.max_restarts}) used up")
        return Decision("restart", f"restart {charged_so_far + 1} of {self.max_restarts}")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The batch of an attempt with some number of workers. kept: "per_replica_batch" (fewer workers,
    more accumulation steps: memory per GPU unchanged), "global_batch" (the per-replica batch grows,
    where accumulation cannot make up the difference evenly) or "as_asked" (all the workers)."""

    global_batch_size: int
    accumulation_steps: int
    per_replica_batch_size: int
    kept: Literal["per_replica_batch", "global_batch", "as_asked"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def elastic_batch(spec: "JobSpec", workers: int) -> BatchPlan | None:
    """How `workers` workers keep the effective batch (global_batch_size x accumulation_steps), and with it
    the steps per epoch, the learning rate and the schedule: first by raising accumulation so each replica's
    batch stays; else by a larger per-replica batch; None when neither divides evenly."""
    full, per_worker = spec.cluster.workers, spec.cluster.replicas_per_worker
    batch, steps = spec.train.global_batch_size, spec.train.accumulation_steps
    if workers == full:
        return BatchPlan(batch, steps, batch // (full * per_worker), "as_asked")
    if (steps * full) % workers == 0:  # the per-replica batch stays, so the global batch shrinks with the workers
        return BatchPlan(batch * workers // full, steps * full // workers, batch // (full * per_worker),
                         "per_replica_batch")
    if batch % (workers * per_worker) == 0:
        return BatchPlan(batch, steps, batch // (workers * per_worker), "global_batch")
    return None


def spec_for_workers(spec: "JobSpec", workers: int) -> "JobSpec":
    """The spec for an attempt with `workers` workers (an elastic restart): the effective batch kept as
    elastic_batch says."""
    if workers == spec.cluster.workers:
        return spec
    batch = elastic_batch(spec, workers)
    train = spec.train.model_copy(update={"global_batch_size": batch.global_batch_size,
                                          "accumulation_steps": batch.accumulation_steps})
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"workers": workers}), "train": train})


def elastic_sizes(spec: "JobSpec", min_workers: int) -> list[int]:
    """Worker counts to try, largest first, from cluster.workers down to `min_workers`, keeping only
    those that keep the effective batch (elastic_batch)."""
    return [w for w in range(spec.cluster.workers, min_workers - 1, -1) if elastic_batch(spec, w) is not None]


class ScalingPolicy:
    """How many workers each reservation asks for, and for how long: the full count first; after a failure,
    with failure.elastic, smaller counts that keep the effective batch (elastic_batch), down to min_workers."""

    def __init__(self, spec: "JobSpec", limits: Limits, elastic_supported: bool):
        self.spec, self.limits, self.elastic_supported = spec, limits, elastic_supported

    def sizes(self, after_failure: bool, full_size_waited: bool = False) -> list[tuple[int, float]]:
        """`full_size_waited`: the held placement group already waited reserve_timeout_s to come back whole,
        so with elastic the full size gets only the short wait the smaller sizes get."""
        spec = self.spec
        full = (spec.cluster.workers, spec.cluster.reserve_timeout_s)
        if not (after_failure and self.elastic_supported and spec.failure.elastic is not None):
            return [full]
        counts = elastic_sizes(spec, spec.failure.elastic.min_workers)
        smaller = min(self.limits.elastic_reserve_timeout_s, spec.cluster.reserve_timeout_s)
        first = (spec.cluster.workers, smaller) if full_size_waited else full
        return [first] + [(n, smaller) for n in counts if n != spec.cluster.workers]


class ReplacementPolicy:
    """Parameter servers: a dead worker is replaced while the attempt's budget lasts and training runs."""

    def __init__(self, workers: int, limits: Limits):
        self.left = limits.replacements_per_worker * workers

    def replace(self, training_done: bool) -> bool:
        if training_done or self.left <= 0:
            return False
        self.left -= 1
        return True


def stop_step(steps: list[int], steps_per_s: float | None, margin_s: float,
              steps_per_epoch: int | None = None) -> int:
    """The step every loop-running rank stops at after a drain notice: past the furthest rank by the steps
    that run while the request travels (`margin_s` of training at the measured rate; at least 2), and never an
    epoch's last step: a train_fn reports an epoch after that step, so stopping there would lose the report
    (the restart resumes past the epoch)."""
    ahead = max(2, math.ceil(steps_per_s * margin_s)) if steps_per_s else 10
    target = max(steps, default=0) + ahead
    return target + 1 if steps_per_epoch and target % steps_per_epoch == 0 else target


def checkpoint_fits(seconds_left: float | None, checkpoint_s: float | None, to_stop_s: float) -> bool:
    """Whether a checkpoint-now can finish before the node goes: the steps to the common stop (`to_stop_s`),
    the save (as long as the last one took, twice over), and a second for the attempt to end. No deadline,
    or no save measured yet: try."""
    if seconds_left is None or checkpoint_s is None:
        return True
    return seconds_left > to_stop_s + 2 * checkpoint_s + 1.0


@dataclasses.dataclass(frozen=True)
class Heard:
    """What the watchdog last took for progress of a rank: its (phase, step) marker, when, and the CPU
    seconds its process had used by then (None until it said)."""

    marker: object
    at: float
    cpu_s: float | None = None


def heard(last: Heard, marker: object, cpu_s: float | None, now: float, hang_timeout_s: float,
          limits: Limits) -> Heard:
    """A rank's progress after one answer: a new step or phase, or, for a loop that says no steps, its
    process computing (CPU time at least `busy_cpu_share` of the wall time since the last progress, over at
    least the busy window). A process asleep, or blocked on a peer that never comes, uses next to no CPU."""
    if marker != last.marker:
        return Heard(marker, now, cpu_s)
    if cpu_s is None:
        return last
    if last.cpu_s is None:  # the first CPU reading: a baseline, not yet progress
        return dataclasses.replace(last, cpu_s=cpu_s)
    window_s = min(limits.busy_window_s, hang_timeout_s / 2)
    elapsed = now - last.at
    if elapsed >= window_s and cpu_s - last.cpu_s >= limits.busy_cpu_share * elapsed:
        return Heard(marker, now, cpu_s)
    return last


def stalled(last_progress_at: dict[int, float], now: float, hang_timeout_s: float) -> list[int]:
    """The ranks whose progress has not changed for longer than hang_timeout_s."""
    return sorted(rank for rank, seen in last_progress_at.items() if now - seen > hang_timeout_s)


def hung_ranks(watched: dict[int, float], before_first: set[int], now: float, hang_timeout_s: float,
               limits: Limits, who: Callable[[list[int]], str], synchronous: bool = False) -> tuple[list[int], str]:
    """The ranks that hung (`watched`: rank -> when it was last heard) and why. A rank of raytf's loop still
    before its first step (`before_first`) has hang_timeout_s or limits.first_step_s, whichever is longer,
    computing or not; the others hang_timeout_s. `who` names ranks as the backend does.
    `synchronous`: ranks judged by their CPU use (a train_fn that says no steps) in a group whose every step is
    a collective of all ranks. There an idle rank may only be waiting for a peer that still computes (its longer
    first trace, the chief's own export): while one does, the idle ones have the longer deadline too."""
    first_s = max(hang_timeout_s, limits.first_step_s)
    hung = sorted(stalled({r: at for r, at in watched.items() if r not in before_first}, now, hang_timeout_s)
                  + stalled({r: at for r, at in watched.items() if r in before_first}, now, first_s))
    if synchronous and hung and len(hung) < len(watched):
        computing = sorted(set(watched) - set(hung))
        hung = stalled(watched, now, first_s)
        if hung:
            return hung, (f"training hung: no progress from {who(hung)} for {first_s:g}s while {who(computing)} "
                          f"computed alone (failure.hang_timeout_s, at least {limits.first_step_s:g}s for a rank "
                          f"that may be waiting for a peer)")
    if not hung:
        return [], ""
    if set(hung) <= before_first:
        return hung, (f"training hung: no first step from {who(hung)} for {first_s:g}s, computing or not (a "
                      f"data.preprocess or input that never returns; failure.hang_timeout_s, at least "
                      f"{limits.first_step_s:g}s for the first step)")
    return hung, f"training hung: no progress from {who(hung)} for {hang_timeout_s:g}s (failure.hang_timeout_s)"


def peer_grace_s(failure_kind: str, limits: Limits) -> float:
    """A dead actor explains its peers' trouble (they are stuck in a collective and would only time out):
    no wait. Otherwise give them a moment to report their own errors."""
    return 0.0 if failure_kind == "actor_died" else limits.peer_error_grace_s
