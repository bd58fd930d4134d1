"""Tune's searchers for a sweep whose points are suggested from the results so far (tune.search.algorithm
optuna or hyperopt): the space in Tune's terms, the searcher, and the id a suggested point goes by.

Grid and random sweeps do not come here: their points are drawn up front (raytf.sweep.expand)."""
from __future__ import annotations

import importlib
from typing import Any

from raytf.errors import SpecError
from raytf.sweep import Dimension, TuneSection

# algorithm -> (the package it needs, Tune's module, the searcher class, the keyword of its seed)
_SEARCHERS = {
    "optuna": ("optuna", "ray.tune.search.optuna", "OptunaSearch", "seed"),
    "hyperopt": ("hyperopt", "ray.tune.search.hyperopt", "HyperOptSearch", "random_state_seed"),
}
EXTRA = "raytf[tune-search]"


def domain(dim: Dimension):
    """One dimension as a Tune search domain."""
    from ray import tune

    if dim.kind == "choice":
        return tune.choice(list(dim.values))
    low, high = dim.values
    return tune.uniform(low, high) if dim.kind == "uniform" else tune.loguniform(low, high)


def param_space(section: TuneSection) -> dict[str, Any]:
    """The trial config Tune's searcher fills in: spec key -> value (keys keep their dots)."""
    return {key: domain(dim) for key, dim in section.space.items()}


def check_installed(section: TuneSection) -> None:
    """The searcher's package missing is a SpecError naming the extra that installs it."""
    package = _SEARCHERS[section.search.algorithm][0]
    try:
        importlib.import_module(package)
    except ImportError:
        raise SpecError(f"tune.search.algorithm {section.search.algorithm} needs the {package} package; "
                        f"install it with: pip install '{EXTRA}'") from None


def searcher(section: TuneSection):
    """The searcher of tune.search.algorithm, seeded with tune.seed, trying points_to_evaluate first."""
    check_installed(section)
    if section.search.algorithm == "optuna":  # its INFO lines ("A new study created...") are not raytf's
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
    _, module, cls, seed_keyword = _SEARCHERS[section.search.algorithm]
    searcher_cls = getattr(importlib.import_module(module), cls)
    points = [dict(p) for p in section.search.points_to_evaluate] or None
    return searcher_cls(metric=section.metric, mode=section.mode, points_to_evaluate=points,
                        **{seed_keyword: section.seed})


def point_id(experiment_tag: str, num_samples: int) -> str:
    """A suggested point's id: t and its place in the order the searcher suggested it, from Tune's running
    count in the trial's experiment tag ("3_lr=..." is the third): ids sort in trial order and stay the
    same after a resume (Tune keeps the count with the searcher's state). t00 is the first."""
    number = int(experiment_tag.split("_", 1)[0]) - 1
    return f"t{number:0{max(2, len(str(num_samples - 1)))}d}"
