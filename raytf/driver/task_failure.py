"""What ends an attempt when a task fails fatally: the errors of its peers, collected as they follow (often broken
collectives, as a consequence), root cause first; and where the task died, a survivor's state saved as the newest
checkpoint (raytf.driver.rescue), so the restart loses no step; the same for the ranks a hang left waiting.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from raytf.driver import failure as failure_lib
from raytf.driver import rescue
from raytf.driver.failure import Failure
from raytf.driver.group import Finished, TaskError
from raytf.driver.policy import Limits, peer_grace_s
from raytf.rendezvous import Task


# What a survivor's state answers: a dead actor, and a collective broken by a peer cut off or stalled (the
# survivors' steps failed in it all the same; the silent peer answers nothing and holds no state).
# A hang: hang_rescue.
RESCUED = ("actor_died", "collective")


def attempt_failure(a, task: Task, error: TaskError, with_it: list[Finished], backend, clock, limits: Limits,
                    rescuing: bool, note: Callable[[str], None]) -> Failure:
    """The failure of attempt `a` (raytf.driver.attempt.Attempt) after `task` failed with `error` (`with_it`: the
    others that returned in the same poll): the errors of the other tasks whose failure is fatal, those that
    returned with it and those that fail within the grace, aggregated. After a death, its peers would only time
    out: none is waited for, unless `rescuing` (raytf's loop under mirrored, with a checkpoint.dir): then their
    collectives are failed at once, their errors collected within Limits.rescue_wait_s, and the furthest one's
    state (theirs after a broken collective too) becomes the newest checkpoint."""
    fatal = lambda handle: backend.supervision[a.task_of[handle].role].on_failure == "fatal"  # noqa: E731
    rank_of = lambda handle: a.task_of[handle].rank  # noqa: E731
    errors = [failure_lib.rank_error(task.rank, error)]
    errors += [failure_lib.rank_error(rank_of(f.handle), f.error) for f in with_it if f.error and fatal(f.handle)]
    seen = {f.handle for f in with_it}
    pending = [h for h in a.awaited + a.side if h not in seen and fatal(h)]
    if rescuing and errors[0].kind == "actor_died":
        errors += rescue.collect(a.group, survivors(a.tasks, errors), pending, rank_of, clock, limits.rescue_wait_s)
    else:  # a peer's broken collective may come first, its dead actor within the grace
        errors += failure_lib.errors_within(pending, a.group.wait, rank_of, clock, peer_grace_s(errors[0].kind, limits))
    failure = failure_lib.aggregate(errors)
    failure = dataclasses.replace(failure, message=backend.failed_task(task) + failure.message)
    if rescuing and failure.kind in RESCUED:  # a survivor not out of its failed step yet (a busy machine): waited for
        _resume_from_survivor(a, survivors(a.tasks, errors), failure, limits, note, leave_s=limits.rescue_wait_s)
    return failure


def hang_rescue(a, failure: Failure, clock, limits: Limits, note: Callable[[str], None]) -> Failure:
    """A hang of attempt `a` under raytf's loop, before its teardown: every rank's collectives are failed, so
    those waiting in one for the stalled rank (its input, user code, a storage write) keep their state at the
    last step all finished, and the furthest one's becomes the newest checkpoint, as after a death. The stalled
    rank holds none; with no rank in a collective, the last checkpoint stands."""
    ranks = [t.rank for t in a.tasks]
    # an aborted collective lets go within milliseconds; the stalled rank never does: not waited for long
    rescue.collect(a.group, ranks, list(a.awaited), lambda handle: a.task_of[handle].rank, clock, limits.hang_release_s)
    _resume_from_survivor(a, ranks, failure, limits, note)
    return failure


def _resume_from_survivor(a, ranks: list[int], failure: Failure, limits: Limits, note: Callable[[str], None],
                          leave_s: float = 0.0) -> None:
    """The furthest of `ranks`' kept states, if past the attempt's own start, uploaded as the newest checkpoint;
    `failure`'s record then says whose it is and the step it holds. After a hang, no rank is waited for: the
    stalled one never leaves its step."""
    saved = rescue.save(a.group, ranks, a.payload.resume_from.step if a.payload.resume_from else 0,
                        limits.rescue_answer_s, limits.rescue_upload_s, note, leave_s)
    if saved is not None:
        failure.details.update(state_from=f"rank {saved.rank}", last_step=max(a.last_step, saved.step))


def survivors(tasks: list[Task], errors: list[failure_lib.RankError]) -> list[int]:
    """The ranks whose actors are alive, as far as `errors` say."""
    dead = {e.rank for e in errors if e.kind == "actor_died"}
    return [t.rank for t in tasks if t.rank not in dead]
