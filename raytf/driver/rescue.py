"""The driver's half of a rescue (raytf.actor.rescue): when a task's actor dies, its peers' collectives are failed at
once, each survivor keeps its state at the last step every worker finished, and the one that got furthest uploads
it to checkpoint.dir; the restart then resumes from it as from any checkpoint, and no step is lost.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from raytf.driver.failure import RankError, errors_within


@dataclasses.dataclass(frozen=True)
class Rescued:
    rank: int  # the survivor whose state the restart resumes from
    step: int  # the global step it holds
    path: str  # the checkpoint it became


def best(points: dict[int, int | None], after_step: int) -> tuple[int, int] | None:
    """(rank, step) of the survivor whose state got furthest (the lowest rank among equals), if past `after_step`
    (the newest checkpoint already there); None when no survivor holds a step further on."""
    held = [(step, -rank) for rank, step in points.items() if step is not None and step > after_step]
    if not held:
        return None
    step, rank = max(held)
    return -rank, step


def collect(group, survivors: list[int], pending: list, rank_of: Callable[[Any], int], clock,
            wait_s: float) -> list[RankError]:
    """Fail the survivors' collectives at once (a peer gone silent would hold them until their timeout), and
    collect their errors as they return, within `wait_s`; each keeps its state on the way out."""
    group.abort_collectives(survivors)
    return errors_within(pending, group.wait, rank_of, clock, wait_s)


def save(group, survivors: list[int], after_step: int, answer_s: float, upload_s: float,
         note: Callable[[str], None], leave_s: float = 0.0) -> Rescued | None:
    """Ask the survivors which step they hold (one still leaving its failed step is waited for up to `leave_s`); the
    furthest uploads it as the newest checkpoint. None: no survivor held a step past `after_step`, or its upload
    did not finish in `upload_s` (the last checkpoint stands)."""
    points = dict(zip(survivors, group.rescue_points(survivors, answer_s, leave_s)))
    chosen = best(points, after_step)
    if chosen is None:
        held = ", ".join(f"rank {r}: {'no answer or none' if s is None else f'step {s}'}" for r, s in points.items())
        note(f"raytf: no survivor kept a state past step {after_step} ({held}); resuming from the last checkpoint")
        return None
    rank, step = chosen
    path = group.upload_rescue(rank, upload_s)
    if path is None:
        note(f"raytf: rank {rank} held step {step} but could not save it within {upload_s:g}s; "
             f"resuming from the last checkpoint")
        return None
    note(f"raytf: rank {rank} kept the state at step {step}: the restart resumes there ({path})")
    return Rescued(rank, step, path)
