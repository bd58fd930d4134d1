"""The learning rate a job trains with: the large-batch scaling rule and the schedule, in optimizer steps
(StepSchedule). Pure (no TensorFlow): the spec checks the schedule before any actor starts, the sweep scales
with the same rule, and the actor turns it into Keras's own schedule classes (raytf.actor.schedules).

Steps are optimizer steps (with train.accumulation_steps K, one per K micro-batches), the count Keras's
optimizer keeps in `iterations` and a checkpoint saves, so a resumed job continues its schedule exactly.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytf.spec import JobSpec


def scaled(lr: float, batch: int, rule: str, base_batch: int) -> float:
    """The learning rate for `batch`, given `lr` tuned at `base_batch`: linear (Goyal et al.) or sqrt."""
    if rule == "none":
        return lr
    ratio = batch / base_batch
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


def peak(spec: "JobSpec") -> float:
    """optimizer.learning_rate, scaled to the job's effective batch when optimizer.scale_lr says so."""
    rule = spec.optimizer.scale_lr
    lr = spec.optimizer.learning_rate
    return lr if rule is None else scaled(lr, spec.train.effective_batch_size, rule.rule, rule.base_batch_size)


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """A schedule in optimizer steps. warmup: a linear ramp over the first `warmup_steps` steps from
    warmup_start_factor x the rate at its end. decay_steps: cosine's decay length after the warmup, or the
    period of step/exponential. boundaries/values: piecewise, in steps."""

    name: str
    peak: float
    total_steps: int
    warmup_steps: int = 0
    warmup_start_factor: float = 0.0
    decay_steps: int = 0
    alpha: float = 0.0
    factor: float = 1.0
    staircase: bool = False
    boundaries: tuple[int, ...] = ()
    values: tuple[float, ...] = ()


def in_steps(spec: "JobSpec", steps_per_epoch: int) -> StepSchedule:
    """The job's schedule for `steps_per_epoch` optimizer steps per epoch; a ValueError names a schedule
    that does not fit in training."""
    schedule = spec.optimizer.schedule
    total = spec.train.epochs * steps_per_epoch
    rate = peak(spec)
    warmup = schedule.warmup.in_steps(steps_per_epoch) if schedule.warmup is not None else 0
    if warmup >= total:
        raise ValueError(f"optimizer.schedule.warmup is {warmup} optimizer steps, not shorter than training's "
                         f"{total} ({spec.train.epochs} epochs x {steps_per_epoch} steps); warm up for less")
    common = dict(name=schedule.name, peak=rate, total_steps=total, warmup_steps=warmup,
                  warmup_start_factor=schedule.warmup.start_factor if schedule.warmup is not None else 0.0)
    if schedule.name == "constant":
        return StepSchedule(**common)
    if schedule.name == "cosine":
        decay = schedule.decay.in_steps(steps_per_epoch) if schedule.decay is not None else total - warmup
        return StepSchedule(**common, decay_steps=decay, alpha=schedule.alpha if schedule.alpha is not None else 0.0)
    if schedule.name in ("step", "exponential"):
        factor = schedule.factor if schedule.factor is not None else 0.1  # step's default: /10 each period
        return StepSchedule(**common, decay_steps=schedule.every.in_steps(steps_per_epoch), factor=factor,
                    staircase=schedule.name == "step" or bool(schedule.staircase))
    boundaries = schedule.boundaries.in_steps(steps_per_epoch)  # piecewise
    if any(b <= a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"optimizer.schedule.boundaries {schedule.boundaries.epochs} epochs fall on steps "
                         f"{boundaries} ({steps_per_epoch} per epoch): two boundaries share a step; space them out")
    return StepSchedule(**common, boundaries=tuple(boundaries), values=(rate, *(rate * f for f in schedule.factors)))
