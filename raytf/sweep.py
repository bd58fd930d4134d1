"""The sweep file: a job spec plus a `tune:` section. Pure: parsing the tune section, and expanding the space
into points (each point validated as a job before any trial starts, its learning rate scaled to its
batch by the job's own rule). How many trials the cluster holds at once is raytf.sweep_capacity. No Ray,
no TensorFlow.

    tune:
      metric: val_loss
      mode: min
      num_samples: 1
      space:
        train.global_batch_size: {grid: [64, 128]}
        optimizer.learning_rate: {loguniform: [0.0001, 0.01]}
      lr_scaling: {rule: linear, base_batch_size: 64}
      scheduler: {name: asha, grace_period: 1}
      max_concurrent_trials: auto

With `search: {algorithm: optuna}` (or hyperopt) the points are not drawn here: Tune's searcher suggests
each from the results so far (raytf.search), and each suggestion is checked as a job inside its trial.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any, Callable, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raytf import learning_rate
from raytf.errors import SpecError
from raytf.job import apply_overrides
from raytf.spec import JobSpec

# Keys a sweep sets itself for every trial: a dimension over them would make trials overwrite each other.
RESERVED_KEYS = ("name", "output.dir", "checkpoint.dir")
# A random point that fails validation is drawn again, up to this many times, before the sweep gives up.
MAX_DRAWS = 50


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One axis of the space: `kind` grid|choice|uniform|loguniform and its values or bounds."""

    kind: str
    values: tuple

    @property
    def random(self) -> bool:
        return self.kind != "grid"

    def sample(self, rng: random.Random) -> Any:
        if self.kind == "choice":
            return rng.choice(self.values)
        low, high = self.values
        if self.kind == "uniform":
            return rng.uniform(low, high)
        return math.exp(rng.uniform(math.log(low), math.log(high)))

    def holds(self, value: Any) -> bool:
        if self.kind in ("grid", "choice"):
            return value in self.values
        low, high = self.values
        return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high

    def describe(self) -> str:
        return f"{self.kind}: {list(self.values)}"


_FORMS = "{grid: [a, b, ...]}, {choice: [a, b, ...]}, {uniform: [low, high]} or {loguniform: [low, high]}"


def parse_dimension(key: str, raw: Any) -> Dimension:
    if not isinstance(raw, Mapping) or len(raw) != 1 or next(iter(raw)) not in ("grid", "choice", "uniform", "loguniform"):
        raise ValueError(f"{key}: {raw!r} is not a dimension; write {_FORMS}")
    kind, values = next(iter(raw.items()))
    if not isinstance(values, list) or not values:
        raise ValueError(f"{key}: {kind} needs a non-empty list, got {values!r}")
    if kind in ("uniform", "loguniform"):
        if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{key}: {kind} needs two numbers [low, high], got {values!r}")
        low, high = float(values[0]), float(values[1])
        if not low < high:
            raise ValueError(f"{key}: {kind} [{low:g}, {high:g}]: low must be below high")
        if kind == "loguniform" and low <= 0:
            raise ValueError(f"{key}: loguniform [{low:g}, {high:g}]: bounds must be above 0; e.g. [0.0001, 0.01]")
        values = [low, high]
    return Dimension(kind, tuple(values))


class LrScaling(_Strict):
    # The learning rate of a trial follows its global batch: linear (lr * batch/base), sqrt, or none.
    rule: Literal["none", "linear", "sqrt"] = "none"
    base_batch_size: int | None = Field(default=None, ge=1)  # default: the job's effective batch


# Which scheduler takes which keys (the rest of SchedulerSpec's are another scheduler's).
SCHEDULER_KEYS = {"asha": {"grace_period", "reduction_factor", "max_t"},
                  "hyperband": {"reduction_factor", "max_t"},
                  "pbt": {"perturbation_interval", "quantile_fraction", "resample_probability"}}


class SchedulerSpec(_Strict):
    # asha stops the worse trials at each rung; hyperband pauses them (their placement group freed) and resumes
    # the promoted ones from their checkpoints; pbt copies a better trial's checkpoint into a worse one and
    # perturbs its values (learning rate, global batch size), the population drawn at random from the space.
    name: Literal["asha", "hyperband", "pbt"]
    grace_period: int = Field(default=1, ge=1)  # asha: epochs every trial runs before it can be stopped
    reduction_factor: float = Field(default=2, gt=1)  # asha, hyperband: 1/this of the trials go on at each rung
    max_t: int | None = Field(default=None, ge=1)  # asha, hyperband: the last rung; default: the most train.epochs
    perturbation_interval: int = Field(default=1, ge=1)  # pbt: epochs between a trial's exploit/explore steps
    quantile_fraction: float = Field(default=0.25, gt=0, le=0.5)  # pbt: the bottom fraction copies the top one
    resample_probability: float = Field(default=0.25, ge=0, le=1)  # pbt: a value drawn anew instead of perturbed

    @model_validator(mode="after")
    def _keys_of_this_scheduler(self) -> "SchedulerSpec":
        foreign = sorted(self.model_fields_set - SCHEDULER_KEYS[self.name] - {"name"})
        if foreign:
            owners = {k: [n for n, keys in SCHEDULER_KEYS.items() if k in keys] for k in foreign}
            raise ValueError("; ".join(f"{k} is {' and '.join(v)}'s, not {self.name}'s" for k, v in owners.items())
                             + f"; {self.name} takes {', '.join(sorted(SCHEDULER_KEYS[self.name]))}")
        return self

    @property
    def pauses(self) -> bool:
        """Trials stop and start again from their checkpoints (hyperband's pause, pbt's exploit)."""
        return self.name in ("hyperband", "pbt")


# tune.search.algorithm: grid and random draw every point up front (grid dimensions crossed, random ones
# drawn with tune.seed); the others are Tune's searchers, which suggest each point from the results so far.
UP_FRONT = ("grid", "random")
SEARCHERS = ("optuna", "hyperopt", "bohb")
# Tune has more searchers; these were never run with raytf's trials.
NOT_YET = {"bayesopt": "never run with raytf's trials", "ax": "never run with raytf's trials",
           "nevergrad": "never run with raytf's trials", "hebo": "never run with raytf's trials",
           "zoopt": "never run with raytf's trials"}


class SearchSpec(_Strict):
    algorithm: str = "grid"  # grid | random (every point drawn up front) | optuna | hyperopt | bohb (each suggested from the results so far; bohb with scheduler hyperband)
    # Points the searcher tries first, each a mapping of every space key to a value: a known-good
    # configuration, or one to compare against.
    points_to_evaluate: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        if value in UP_FRONT or value in SEARCHERS:
            return value
        if value in NOT_YET:
            raise ValueError(f"{value!r} is not supported yet ({NOT_YET[value]}); use one of "
                             f"{', '.join(UP_FRONT + SEARCHERS)}")
        raise ValueError(f"{value!r} is not a search algorithm; use one of {', '.join(UP_FRONT + SEARCHERS)}")

    @property
    def suggests(self) -> bool:
        """Tune's searcher suggests each point from the results so far (not drawn up front)."""
        return self.algorithm in SEARCHERS


class TuneSection(_Strict):
    metric: str
    mode: Literal["min", "max"]
    num_samples: int = Field(default=1, ge=1)
    space: dict[str, Dimension] = Field(default_factory=dict)
    lr_scaling: LrScaling = LrScaling()
    scheduler: SchedulerSpec | None = None
    max_concurrent_trials: Union[Literal["auto"], int] = "auto"
    seed: int = 0  # for the random dimensions, and a searcher's own generator
    search: SearchSpec = SearchSpec()
    reuse_processes: bool = True  # a trial runs in the processes of the one before it on the same resources, when they match (no TensorFlow import); not under a scheduler; false: new processes for every trial

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    @field_validator("space", mode="before")
    @classmethod
    def _dimensions(cls, raw: Any) -> dict[str, Dimension]:
        if not isinstance(raw, Mapping):
            raise ValueError(f"expected a mapping of spec keys to dimensions, got {raw!r}")
        out = {}
        for key, value in raw.items():
            if key in RESERVED_KEYS:
                raise ValueError(f"{key}: set by the sweep for every trial; it cannot be a dimension")
            out[str(key)] = value if isinstance(value, Dimension) else parse_dimension(key, value)
        return out

    @property
    def values_in_config(self) -> bool:
        """Tune fills each trial's config with the space's values (a searcher suggests them, or pbt's population
        is drawn and perturbed by Tune), instead of raytf drawing every point up front."""
        return self.search.suggests or (self.scheduler is not None and self.scheduler.name == "pbt")

    @model_validator(mode="after")
    def _search_fits_the_space(self) -> "TuneSection":
        search = self.search
        if self.scheduler is not None and self.scheduler.pauses:
            for key in self.space:
                if key == "train.epochs" or key.startswith("cluster."):
                    raise ValueError(f"space.{key}: {self.scheduler.name} stops and restarts trials at epochs of one "
                                     f"schedule, in the placement group each trial started with; keep {key} out of "
                                     f"the space (or use scheduler asha)")
        if self.scheduler is not None and self.scheduler.name == "pbt":
            if search.suggests or search.points_to_evaluate:
                raise ValueError(f"search: pbt draws its population at random from the space and then perturbs "
                                 f"it; drop tune.search (or use scheduler asha or hyperband with {search.algorithm})")
            if not self.space:
                raise ValueError("scheduler: pbt perturbs the space's values; add tune.space (e.g. "
                                 "optimizer.learning_rate: {loguniform: [0.0001, 0.01]})")
            for key, dim in self.space.items():
                if dim.kind == "grid":
                    raise ValueError(f"space.{key}: pbt draws its population at random; write {{choice: {list(dim.values)}}}")
        if search.suggests:
            if not self.space:
                raise ValueError(f"search.algorithm: {search.algorithm} needs a space to search; add tune.space")
            if search.algorithm == "bohb" and (self.scheduler is None or self.scheduler.name != "hyperband"):
                raise ValueError("search.algorithm: bohb suggests points for HyperBand's brackets and learns from "
                                 "their rungs; add scheduler: {name: hyperband}")
            for key, dim in self.space.items():
                if dim.kind == "grid":
                    raise ValueError(f"space.{key}: a grid is crossed up front; with search {search.algorithm} "
                                     f"write {{choice: {list(dim.values)}}}")
        elif search.points_to_evaluate:
            raise ValueError(f"search.points_to_evaluate: tried first by a searcher ({', '.join(SEARCHERS)}); "
                             f"with {search.algorithm}, put the values in the space's grid")
        for i, point in enumerate(search.points_to_evaluate):
            missing = [k for k in self.space if k not in point]
            unknown = [k for k in point if k not in self.space]
            if missing or unknown:
                raise ValueError(f"search.points_to_evaluate[{i}]: " + "; ".join(
                    ([f"missing {', '.join(missing)}"] if missing else [])
                    + ([f"{', '.join(unknown)} not in tune.space"] if unknown else []))
                    + f"; give a value for each of {', '.join(self.space)}")
            for key, value in point.items():
                if not self.space[key].holds(value):
                    raise ValueError(f"search.points_to_evaluate[{i}]: {key}: {value!r} is outside the space "
                                     f"({self.space[key].describe()})")
        return self

    @field_validator("max_concurrent_trials", mode="before")
    @classmethod
    def _count(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"{value!r} is not a trial count; use auto or a number >= 1")


def split_sweep(raw: Mapping[str, Any], source: str) -> tuple[dict[str, Any], TuneSection]:
    """A sweep file's mapping -> (the job spec part, the validated tune section)."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"{source}: expected a mapping (a job spec plus a tune: section)")
    job_raw = dict(raw)
    tune_raw = job_raw.pop("tune", None)
    if tune_raw is None:
        raise SpecError(f"{source}: no tune: section; a sweep file is a job spec plus tune: {{metric, mode, space}} "
                        f"(to train one job, use `raytf run {source}`)")
    return job_raw, parse_tune(tune_raw, source)


def parse_tune(raw: Any, source: str = "sweep") -> TuneSection:
    if not isinstance(raw, Mapping):
        raise SpecError(f"{source}: tune: expected a mapping with metric, mode and space, got {raw!r}")
    try:
        return TuneSection.model_validate(dict(raw))
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(["tune", *(str(p) for p in err["loc"] if not str(p).startswith(("literal", "int")))])
            if err["type"] == "extra_forbidden":
                known = _known(err["loc"][:-1])
                lines.append(f"{where}: unknown key; known keys here: {', '.join(known)}")
            elif err["type"] == "missing":
                lines.append(f"{where}: missing; add it to the tune section")
            elif err["type"] == "value_error":
                msg = err["msg"].removeprefix("Value error, ")
                # A dimension's error starts with its spec key (tune.space.<key>: ...); a check across keys
                # starts with the key it names (tune.search...: ...)
                joined = where in ("tune.space", "tune") and not msg.startswith("expected")
                lines.append(f"{where}.{msg}" if joined else f"{where}: {msg}")
            elif err["type"] == "literal_error":
                lines.append(f"{where}: {err['input']!r} is not one of {err['ctx']['expected']}")
            else:
                lines.append(f"{where}: {err['msg'].lower()} (got {err['input']!r})")
        raise SpecError(f"{source}: " + "; ".join(dict.fromkeys(lines))) from None


def _known(loc: tuple) -> list[str]:
    model: type[BaseModel] = TuneSection
    for part in loc:
        field = model.model_fields.get(str(part))
        inner = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                 if isinstance(a, type) and issubclass(a, BaseModel)] if field else []
        if not inner:
            break
        model = inner[0]
    return list(model.model_fields)


def apply_sweep_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`--set` on a sweep file: job keys as for `raytf run`; `tune.space.<spec key>` sets one dimension
    (its key has dots of its own)."""
    plain = {k: v for k, v in overrides.items() if not k.startswith("tune.space.")}
    out = apply_overrides(raw, plain)
    for key, value in overrides.items():
        if key.startswith("tune.space."):
            tune = out.setdefault("tune", {})
            if not isinstance(tune, dict):
                raise SpecError(f"--set {key}: tune is not a section")
            tune.setdefault("space", {})[key.removeprefix("tune.space.")] = value
    return out


# ---------------------------------------------------------------- points


@dataclasses.dataclass(frozen=True)
class Point:
    """One trial's configuration: the space's values, and the spec overrides that make its job."""

    id: str
    values: dict[str, Any]  # the space's values, as sampled (learning rate before scaling)
    overrides: dict[str, Any]  # dotted spec keys -> values, the scaling rule and repeat seed included
    repeat: int = 0
    learning_rate: float | None = None  # the peak rate the trial trains with, after scaling

    def describe(self) -> str:
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in self.values.items()) + "}"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def plain(value: Any) -> Any:
    """A value as Python's own type: a searcher may suggest NumPy scalars (BOHB's int64 for a choice of
    ints), which neither JSON nor a spec's strict types take."""
    return value.item() if hasattr(value, "item") and hasattr(value, "dtype") else value


def point_overrides(values: Mapping[str, Any], base: JobSpec, section: TuneSection, repeat: int) -> dict[str, Any]:
    """The spec overrides of one point: its values, then tune.lr_scaling as the job's own
    optimizer.scale_lr (each trial scales its rate to its effective batch, by the same code as a plain
    run), then the seed of a repeat (repeat r of a point trains with train.seed + r, or repeats would be
    identical)."""
    out = dict(values)
    rule = section.lr_scaling.rule
    if rule != "none":
        if base.optimizer.scale_lr is not None:
            raise SpecError("tune.lr_scaling and optimizer.scale_lr both scale the learning rate; keep one "
                            "(optimizer.scale_lr alone scales every trial to its own batch)")
        base_batch = section.lr_scaling.base_batch_size or base.train.effective_batch_size
        out["optimizer.scale_lr"] = {"rule": rule, "base_batch_size": base_batch}
    if repeat and "train.seed" not in values:
        out["train.seed"] = base.train.seed + repeat
    return out


def expand(section: TuneSection, base: JobSpec, check: Callable[[str, dict[str, Any]], Any]) -> tuple[list[Point], list[dict]]:
    """Every point of the sweep, each checked by `check(point_id, overrides)` (which returns the point's
    JobSpec, or raises SpecError for a job that cannot run) before any trial starts. A grid point that fails is an error naming the point; a
    random draw that fails is rejected and drawn again. Returns (points, rejected draws).

    Order: for each sample, the grid's product (the first key varies slowest); random dimensions are drawn
    from a generator seeded with tune.seed, so a sweep, and so its resume, always has the same points."""
    grid_keys = [k for k, d in section.space.items() if not d.random]
    random_dims = {k: d for k, d in section.space.items() if d.random}
    combos = list(itertools.product(*(section.space[k].values for k in grid_keys)))
    total = section.num_samples * len(combos)
    width = max(2, len(str(total - 1)))
    rng = random.Random(section.seed)
    points, rejected = [], []
    for repeat in range(section.num_samples):
        for combo in combos:
            pid = f"p{len(points):0{width}d}"
            fixed = dict(zip(grid_keys, combo))
            for draw in range(MAX_DRAWS if random_dims else 1):
                values = {**fixed, **{k: d.sample(rng) for k, d in random_dims.items()}}
                values = {k: values[k] for k in section.space}  # the space's order
                overrides = point_overrides(values, base, section, repeat)
                point = Point(pid, values, overrides, repeat)
                try:
                    trial = check(pid, overrides)
                    point = dataclasses.replace(point, learning_rate=learning_rate.peak(trial))
                except SpecError as exc:
                    if not random_dims:
                        raise SpecError(f"point {pid} {point.describe()} cannot run: {exc}") from None
                    rejected.append({"point": pid, "values": values, "reason": str(exc)})
                    continue
                points.append(point)
                break
            else:
                raise SpecError(f"point {pid}: none of {MAX_DRAWS} random draws {_fixed(fixed)}can run; the last: "
                                f"{rejected[-1]['reason']}; narrow the random dimensions")
    return points, rejected


def _fixed(fixed: Mapping[str, Any]) -> str:
    return f"with {dict(fixed)} " if fixed else ""


def reported_metrics(spec: JobSpec) -> list[str] | None:
    """The metrics raytf's loop reports each epoch; None when a train_fn reports its own."""
    if spec.train_fn is not None:
        return None
    from raytf import backends

    names = ["loss", *spec.metrics]
    if backends.get(spec.strategy).validation_each_epoch(spec):
        names += [f"val_{n}" for n in names]
    return names


def check_metric(section: TuneSection, spec: JobSpec, source: str) -> None:
    known = reported_metrics(spec)
    if known is not None and section.metric not in known:
        raise SpecError(f"{source}: tune.metric: {section.metric!r} is not reported by this job; "
                        f"it reports {', '.join(known)}")
