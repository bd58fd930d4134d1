"""What went wrong in an attempt, and what to do about it: pure functions, no Ray, no TensorFlow.

The controller turns whatever it saw (exceptions from ranks, a stalled rank, a start-up error) into a
Failure, root cause first; raytf.driver.policy decides what to do about it
smaller worker counts may replace a full-size restart the cluster cannot hold.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

Kind = Literal["actor_died", "hang", "collective", "io", "startup", "checkpoint", "preempted", "resized", "error"]

# Infrastructure trouble is worth a restart; an error in the user's code would only repeat.
RESTARTABLE: frozenset[str] = frozenset({"actor_died", "hang", "collective", "io", "startup", "checkpoint"})

# TensorFlow's errors when a peer of a collective vanishes or the network breaks.
_COLLECTIVE_ERRORS = {"UnavailableError", "CancelledError", "DeadlineExceededError", "AbortedError",
                      "InternalError", "UnknownError"}
_IO_ERRORS = {"OSError", "IOError", "ConnectionError", "ConnectionResetError", "TimeoutError", "BrokenPipeError"}


@dataclasses.dataclass(frozen=True)
class RankError:
    rank: int
    kind: Kind
    message: str
    traceback: str | None = None


@dataclasses.dataclass(frozen=True)
class Failure:
    kind: Kind
    message: str  # root cause first, then the others grouped
    ranks: tuple[int, ...]  # the ranks of the root cause
    causes: dict  # message -> ranks, root cause first
    details: dict = dataclasses.field(default_factory=dict)  # more for result.json's restart entry
    traceback: str | None = None  # every failing rank's, root cause first, each headed by its rank
    per_rank: dict = dataclasses.field(default_factory=dict)  # rank -> {"error", "traceback"}: result.json's tasks


def classify(type_name: str, message: str, actor_died: bool = False) -> Kind:
    if actor_died:
        return "actor_died"
    if type_name == "CheckpointCorrupt":
        return "checkpoint"
    if type_name in _COLLECTIVE_ERRORS or "collective" in message.lower():
        return "collective"
    if type_name in _IO_ERRORS:
        return "io"
    return "error"


_ROOT_ORDER = {"actor_died": 0, "hang": 1, "startup": 2, "checkpoint": 3, "error": 4, "io": 5, "collective": 6,
               "preempted": 7, "resized": 8}


def aggregate(errors: list[RankError]) -> Failure:
    """Root cause first: a dead actor explains its peers' broken collectives, and so does a user error;
    within a kind, the first seen wins. Identical messages are grouped by rank."""
    if not errors:
        raise ValueError("no errors to aggregate")
    ordered = sorted(enumerate(errors), key=lambda ie: (_ROOT_ORDER[ie[1].kind], ie[0]))
    causes: dict[str, list[int]] = {}
    for _, e in ordered:
        causes.setdefault(e.message, []).append(e.rank)
    causes = {msg: sorted(set(ranks)) for msg, ranks in causes.items()}
    root = ordered[0][1]
    lines = [f"rank(s) {', '.join(map(str, ranks))}: {msg}" for msg, ranks in causes.items()]
    message = lines[0] + ("; then " + "; ".join(lines[1:]) if len(lines) > 1 else "")
    per_rank = {e.rank: {"error": e.message, "traceback": e.traceback} for _, e in ordered}
    return Failure(kind=root.kind, message=message, ranks=tuple(causes[root.message]), causes=causes,
                   traceback=all_tracebacks([e for _, e in ordered]), per_rank=per_rank)


def all_tracebacks(errors: list[RankError]) -> str | None:
    """Each failing rank's traceback in the order given (root cause first), headed by its rank: with two ranks
    failing differently, both are kept (only the first was)."""
    kept = [(e.rank, e.traceback) for e in errors if e.traceback]
    if len(kept) <= 1:
        return kept[0][1] if kept else None
    return "\n".join(f"--- rank {rank} ---\n{text.rstrip()}" for rank, text in kept)


def rank_error(rank: int, error) -> RankError:
    """A task's error (raytf.driver.group.TaskError) as one rank's, classified."""
    return RankError(rank, classify(error.type_name, error.message, actor_died=error.actor_died), error.described,
                     error.traceback)


def errors_within(pending: list, wait, rank_of, clock, grace_s: float) -> list[RankError]:
    """The errors of the `pending` tasks (handles) that fail within `grace_s`: after one task failed, its peers'
    own errors (often broken collectives, as a consequence) are collected before the attempt ends.
    `wait(handles, timeout_s)` returns those that finished; `rank_of(handle)` names a task's rank."""
    errors, pending = [], list(pending)
    deadline = clock.now() + grace_s
    while pending:
        for finished in wait(pending, max(0.0, deadline - clock.now())):
            pending.remove(finished.handle)
            if finished.error is not None:
                errors.append(rank_error(rank_of(finished.handle), finished.error))
        if clock.now() >= deadline:
            break
    return errors
