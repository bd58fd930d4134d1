"""The `optimizer:` section of the job spec: the optimizer, its peak learning rate, the schedule over
optimizer steps (with an optional warmup) and the large-batch scaling rule. Pydantic models, each field
checked on its own; raytf.learning_rate turns them into the rate of every step.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from raytf.spec_strict import StrictModel


class Span(StrictModel):
    """A length of training: in epochs (fractions allowed) or in optimizer steps."""

    epochs: float | None = Field(default=None, gt=0, description=(
        "The length in epochs (fractions allowed); give this or steps."))
    steps: int | None = Field(default=None, ge=1, description="The length in optimizer steps; give this or epochs.")

    @model_validator(mode="after")
    def _one_unit(self) -> "Span":
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("give epochs or steps (one of them), e.g. {epochs: 2} or {steps: 500}")
        return self

    def in_steps(self, steps_per_epoch: int) -> int:
        return self.steps if self.steps is not None else max(1, round(self.epochs * steps_per_epoch))


class WarmupSpec(Span):
    start_factor: float = Field(default=0.0, ge=0, lt=1, description=(
        "The ramp starts at start_factor x the rate it leads to (Goyal et al. start from the unscaled rate: "
        "start_factor = base_batch_size / effective batch)."))


class BoundariesSpec(StrictModel):
    epochs: list[float] | None = Field(default=None, description=(
        "Where the rate changes, in epochs: a strictly increasing list above 0; give this or steps."))
    steps: list[int] | None = Field(default=None, description=(
        "Where the rate changes, in optimizer steps: a strictly increasing list above 0; give this or epochs."))

    @model_validator(mode="after")
    def _increasing(self) -> "BoundariesSpec":
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("give epochs or steps (one list), e.g. {epochs: [30, 60]}")
        values = self.epochs if self.epochs is not None else self.steps
        if not values or values[0] <= 0 or any(b <= a for a, b in zip(values, values[1:])):
            raise ValueError(f"{values} must be a non-empty, strictly increasing list of values above 0")
        return self

    def in_steps(self, steps_per_epoch: int) -> list[int]:
        return list(self.steps) if self.steps is not None else [round(e * steps_per_epoch) for e in self.epochs]


# Each schedule's keys (besides name); the first of "required" must be given.
SCHEDULE_KEYS = {
    "constant": {"optional": ("warmup",), "required": ()},
    "cosine": {"optional": ("warmup", "alpha", "decay"), "required": ()},
    "step": {"optional": ("warmup", "factor"), "required": ("every",)},
    "exponential": {"optional": ("warmup", "staircase"), "required": ("every", "factor")},
    "piecewise": {"optional": ("warmup",), "required": ("boundaries", "factors")},
}
SCHEDULE_EXAMPLES = {
    "constant": "{name: constant, warmup: {epochs: 1}}",
    "cosine": "{name: cosine, alpha: 0.01, warmup: {epochs: 1}}",
    "step": "{name: step, every: {epochs: 30}, factor: 0.1}",
    "exponential": "{name: exponential, every: {steps: 1000}, factor: 0.96}",
    "piecewise": "{name: piecewise, boundaries: {epochs: [30, 60]}, factors: [0.1, 0.01]}",
}


class ScheduleSpec(StrictModel):
    """The learning rate over optimizer steps, from optimizer.learning_rate (after scale_lr): constant;
    cosine down to alpha x the rate (over `decay`, default the rest of training after warmup); step:
    x factor every `every`; exponential: x factor per `every` (staircase: in whole periods); piecewise:
    the rate x factors[i] from boundaries[i] on. An optional linear warmup leads into any of them."""

    name: Literal["constant", "cosine", "step", "exponential", "piecewise"] = Field(default="constant", description=(
        "The schedule; each takes only its own keys (cosine: alpha, decay; step: every, factor; exponential: every, "
        "factor, staircase; piecewise: boundaries, factors), and warmup."))
    warmup: WarmupSpec | None = Field(default=None, description=(
        "A linear warmup in front of the schedule, from start_factor x the rate up to it."))
    alpha: float | None = Field(default=None, ge=0, le=1, description="cosine: decay down to alpha x the rate.")
    decay: Span | None = Field(default=None, description=(
        "cosine: the span to decay over. None: the rest of training after the warmup."))
    every: Span | None = Field(default=None, description="step and exponential: the period of each change.")
    factor: float | None = Field(default=None, gt=0, description=(
        "step: the rate x factor every period; exponential: x factor per period."))
    staircase: bool | None = Field(default=None, description=(
        "exponential: change in whole periods rather than continuously."))
    boundaries: BoundariesSpec | None = Field(default=None, description="piecewise: where the rate changes.")
    factors: list[Annotated[float, Field(gt=0)]] | None = Field(default=None, description=(
        "piecewise: the rate x factors[i] from boundaries[i] on; one factor per boundary."))

    @model_validator(mode="after")
    def _keys_of_the_schedule(self) -> "ScheduleSpec":
        keys = SCHEDULE_KEYS[self.name]
        allowed = (*keys["required"], *keys["optional"])
        given = [k for k in type(self).model_fields if k != "name" and getattr(self, k) is not None]
        extra = [k for k in given if k not in allowed]
        if extra:
            raise ValueError(f"{extra[0]} is not a key of schedule {self.name} (it takes "
                             f"{', '.join(allowed) or 'no keys'}); e.g. {SCHEDULE_EXAMPLES[self.name]}")
        missing = [k for k in keys["required"] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"schedule {self.name} needs {' and '.join(missing)}; e.g. {SCHEDULE_EXAMPLES[self.name]}")
        if self.name == "piecewise":
            count = len(self.boundaries.epochs or self.boundaries.steps)
            if len(self.factors) != count:
                raise ValueError(f"piecewise: {count} boundaries need {count} factors (the rate x factors[i] from "
                                 f"boundaries[i] on), got {len(self.factors)}")
        return self


class ScaleLrSpec(StrictModel):
    """The large-batch rule: learning_rate was tuned at base_batch_size; the job trains at its effective
    batch (train.global_batch_size x train.accumulation_steps) with the rate x ratio (linear, Goyal et
    al.) or x sqrt(ratio)."""

    rule: Literal["linear", "sqrt"] = Field(description=(
        "linear: the rate x (effective batch / base_batch_size); sqrt: x its square root."))
    base_batch_size: int = Field(ge=1, description="The batch size optimizer.learning_rate was tuned at.")


class OptimizerSpec(StrictModel):
    name: str = Field(default="adam", description="A Keras optimizer name, e.g. adam, sgd.")
    learning_rate: float = Field(default=0.001, gt=0, description=(
        "The peak rate; at scale_lr's base_batch_size when scale_lr is set."))
    schedule: ScheduleSpec = Field(default=ScheduleSpec(), description="The learning rate over optimizer steps.")
    scale_lr: ScaleLrSpec | None = Field(default=None, description=(
        "Scale the rate by the effective batch (the large-batch rule). None: as given."))
    options: dict[str, Any] = Field(default_factory=dict, description=(
        "Other constructor arguments of the optimizer, e.g. {momentum: 0.9}; not learning_rate, not "
        "gradient_accumulation_steps."))

    @field_validator("options")
    @classmethod
    def _not_ours(cls, options: dict[str, Any]) -> dict[str, Any]:
        if "learning_rate" in options:
            raise ValueError("learning_rate belongs in optimizer.learning_rate (and a schedule in optimizer.schedule)")
        bad = {k: v for k, v in options.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad:
            raise ValueError(f"{bad} is not a finite number; give a finite value")
        if "gradient_accumulation_steps" in options:
            raise ValueError("gradient_accumulation_steps: use train.accumulation_steps; Keras's own counts "
                             "micro-batches as schedule steps and all-reduces every micro-batch")
        return options
