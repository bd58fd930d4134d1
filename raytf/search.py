"""Tune's side of a sweep's search: the space in Tune's terms, the searcher (tune.search.algorithm optuna,
hyperopt or bohb: each point suggested from the results so far), the scheduler (asha, hyperband, pbt; under
bohb, Tune's HyperBandForBOHB), and the id a point goes by when Tune fills the trial's config.

The points of a grid or random search are drawn up front instead (raytf.sweep.expand)."""
from __future__ import annotations

import functools
import importlib
from typing import Any

from raytf.errors import SpecError
from raytf.sweep import Dimension, TuneSection

# algorithm -> (the packages it needs, Tune's module, the searcher class, the keyword of its seed)
_SEARCHERS = {
    "optuna": (("optuna",), "ray.tune.search.optuna", "OptunaSearch", "seed"),
    "hyperopt": (("hyperopt",), "ray.tune.search.hyperopt", "HyperOptSearch", "random_state_seed"),
    "bohb": (("hpbandster", "ConfigSpace"), "ray.tune.search.bohb", "TuneBOHB", "seed"),
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
    for package in _SEARCHERS[section.search.algorithm][0]:
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


def point_id(experiment_tag: str, section: TuneSection) -> str:
    """A trial's point id when Tune fills its config: t and its place in the order Tune created it, from
    Tune's running count in the trial's experiment tag (a searcher's count starts at 1, "3_lr=..." being the
    third; pbt's random population's at 0): ids sort in trial order and stay the same after a resume (Tune
    keeps the count with its state). t00 is the first."""
    number = int(experiment_tag.split("_", 1)[0]) - (1 if section.search.suggests else 0)
    return f"t{number:0{max(2, len(str(section.num_samples - 1)))}d}"


def mutations(section: TuneSection) -> dict[str, Any]:
    """pbt's hyperparam_mutations: a choice explores its neighbouring values, a range is scaled by 0.8 or 1.2
    (or, with resample_probability, drawn anew from the space)."""
    return {key: list(dim.values) if dim.kind == "choice" else domain(dim) for key, dim in section.space.items()}


def search_algorithm(section: TuneSection):
    """What creates the trials: the searcher; for pbt, Tune's random draws from the space (seeded), every
    member at once; None for points drawn up front (a grid over their ids)."""
    if section.search.suggests:
        return searcher(section)
    if section.values_in_config:
        from ray.tune.search import BasicVariantGenerator

        return BasicVariantGenerator(random_state=section.seed, max_concurrent=0)
    return None


def creates_every_trial_at_once(section: TuneSection) -> bool:
    """Under hyperband and pbt every trial exists from the start and placement groups alone limit how many
    run: Tune counts a paused trial against max_concurrent_trials, so a cap would keep the trial that could use
    a paused one's resources from ever being created (hyperband's later brackets, pbt's population)."""
    return section.scheduler is not None and section.scheduler.pauses


def how_many_at_once(section: TuneSection, limit: int) -> str:
    """The sweep's first line on concurrency: `limit`, or (hyperband, pbt) what the cluster holds, saying so when a
    tune.max_concurrent_trials number was given and does not apply."""
    if not creates_every_trial_at_once(section):
        return f"up to {limit} at once"
    if section.max_concurrent_trials == "auto":
        return "as many at once as the cluster holds"
    return (f"as many at once as the cluster holds (tune.max_concurrent_trials {section.max_concurrent_trials} does "
            f"not apply under {section.scheduler.name}: Tune counts a paused trial against it)")


def scheduler(section: TuneSection, max_t: int):
    """tune.scheduler as Tune's scheduler. Time is the job's epoch: a trial started again from a checkpoint
    reports its epochs where it left off, which Tune's own count of reports would not say."""
    from ray.tune.schedulers import ASHAScheduler, HyperBandScheduler

    s = section.scheduler
    if s is None:
        return None
    if s.name == "asha":
        return ASHAScheduler(time_attr="training_iteration", grace_period=s.grace_period,
                             reduction_factor=s.reduction_factor, max_t=max_t)
    if s.name == "hyperband":
        if section.search.algorithm == "bohb":  # BOHB's brackets: the searcher learns from each rung's results
            from ray.tune.schedulers import HyperBandForBOHB

            return HyperBandForBOHB(time_attr="epoch", max_t=max_t, reduction_factor=s.reduction_factor)
        return HyperBandScheduler(time_attr="epoch", max_t=max_t, reduction_factor=s.reduction_factor)
    bounds = {k: d.values for k, d in section.space.items() if d.kind in ("uniform", "loguniform")}
    return _population_based_training(max_t, time_attr="epoch", perturbation_interval=s.perturbation_interval,
                                      hyperparam_mutations=mutations(section), quantile_fraction=s.quantile_fraction,
                                      resample_probability=s.resample_probability, log_config=False, synch=True,
                                      custom_explore_fn=functools.partial(within_bounds, bounds))


def within_bounds(bounds: dict[str, tuple[float, float]], config: dict[str, Any]) -> dict[str, Any]:
    """pbt's explore scales a range's value by 0.8 or 1.2 without looking at the range: kept inside it."""
    for key, (low, high) in bounds.items():
        if key in config:
            config[key] = min(max(config[key], low), high)
    return config


def _population_based_training(last_epoch: int, **options):
    """Tune's PBT, synchronous (every trial reaches the epoch before any exploits, so a trial takes the state a
    better one had at that same epoch, and no epoch is trained again), and never at a trial's last epoch:
    its job has ended there (Tune's PBT would exploit at any epoch)."""
    from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

    class PopulationBasedTrainingToTheLastEpoch(PopulationBasedTraining):
        def on_trial_result(self, tune_controller, trial, result):
            if result.get(self._time_attr, 0) >= last_epoch:
                return TrialScheduler.CONTINUE
            return super().on_trial_result(tune_controller, trial, result)

    return PopulationBasedTrainingToTheLastEpoch(**options)
