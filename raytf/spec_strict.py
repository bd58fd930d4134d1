"""The base of every job-spec section model: unknown keys are errors, values are frozen, and numbers are
numbers (no NaN or infinity, no yes/no taken for one). Its own module so that the spec's sections can live
in several modules (raytf.spec, raytf.spec_optimizer) without importing each other.
"""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, model_validator

_NUMBERS = (int, float, int | None, float | None)


class StrictModel(BaseModel):
    # allow_inf_nan=False: `learning_rate: .inf` or a NaN timeout is refused, naming the key
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_yes_no_for_numbers(cls, raw: Any) -> Any:
        """`workers: true` is not 1: pydantic would take a bool for an int or a float."""
        if isinstance(raw, Mapping):
            for key, value in raw.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if isinstance(value, bool) and field is not None and field.annotation in _NUMBERS:
                    raise ValueError(f"{key}: {value!r} is yes/no, not a number; give a number")
        return raw
