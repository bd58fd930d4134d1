"""A learning-rate schedule in optimizer steps (raytf.learning_rate.StepSchedule) as Keras's own schedule
classes, plus the one Keras lacks: a linear warmup in front of any schedule. Keras evaluates a schedule at
`optimizer.iterations`, which raytf advances once per optimizer step (once per train.accumulation_steps
micro-batches)."""
from __future__ import annotations

import keras
from keras.optimizers import schedules

from raytf.learning_rate import StepSchedule


@keras.saving.register_keras_serializable(package="raytf")
class LinearWarmup(schedules.LearningRateSchedule):
    """`after` from step `warmup_steps` on; before it, a straight line from start_factor x after(warmup_steps)
    up to after(warmup_steps) (the same ramp as CosineDecay's own warmup: start + (end - start) x step/warmup)."""

    def __init__(self, after, warmup_steps: int, start_factor: float = 0.0):
        self.after, self.warmup_steps, self.start_factor = after, int(warmup_steps), float(start_factor)

    def _after(self, step):
        return self.after(step) if callable(self.after) else keras.ops.convert_to_tensor(self.after, "float32")

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        end = keras.ops.cast(self._after(keras.ops.convert_to_tensor(float(self.warmup_steps))), "float32")
        start = self.start_factor * end
        ramp = start + (end - start) * step / float(self.warmup_steps)
        return keras.ops.where(step < self.warmup_steps, ramp, keras.ops.cast(self._after(step), "float32"))

    def get_config(self):
        after = keras.saving.serialize_keras_object(self.after) if callable(self.after) else self.after
        return {"after": after, "warmup_steps": self.warmup_steps, "start_factor": self.start_factor}

    @classmethod
    def from_config(cls, config):
        after = config["after"]
        if isinstance(after, dict):
            after = keras.saving.deserialize_keras_object(after)
        return cls(after, config["warmup_steps"], config["start_factor"])


def build_schedule(schedule: StepSchedule):
    """`schedule` as what a Keras optimizer takes for learning_rate: a float (constant, no warmup) or a
    LearningRateSchedule."""
    if schedule.name == "cosine":  # Keras's CosineDecay has its own warmup, and decays after it
        if schedule.warmup_steps:
            return schedules.CosineDecay(schedule.warmup_start_factor * schedule.peak, schedule.decay_steps, alpha=schedule.alpha,
                                         warmup_target=schedule.peak, warmup_steps=schedule.warmup_steps)
        return schedules.CosineDecay(schedule.peak, schedule.decay_steps, alpha=schedule.alpha)
    if schedule.name in ("step", "exponential"):
        after = schedules.ExponentialDecay(schedule.peak, schedule.decay_steps, schedule.factor, staircase=schedule.staircase)
    elif schedule.name == "piecewise":
        after = schedules.PiecewiseConstantDecay(list(schedule.boundaries), list(schedule.values))
    else:
        after = schedule.peak
    return LinearWarmup(after, schedule.warmup_steps, schedule.warmup_start_factor) if schedule.warmup_steps else after


def constant_rate(optimizer) -> float | None:
    """The optimizer's learning rate when it is a value (not a schedule): a variable a checkpoint restores."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    rate = inner._learning_rate
    if isinstance(rate, schedules.LearningRateSchedule):
        return None
    return float(keras.ops.convert_to_numpy(rate))


def set_constant_rate(optimizer, rate: float) -> None:
    getattr(optimizer, "inner_optimizer", optimizer).learning_rate = rate


def learning_rate_at(optimizer, step: int) -> float:
    """The learning rate the optimizer uses for optimizer step `step` (0-based)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer wraps the real one
    rate = inner._learning_rate  # the schedule or the value itself (`learning_rate` evaluates it at iterations)
    if isinstance(rate, schedules.LearningRateSchedule):
        return float(rate(step))
    return float(keras.ops.convert_to_numpy(rate))
