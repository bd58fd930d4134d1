"""The job spec's rules across sections and strategies: what no single field can check on its own.

Run by `raytf.job.parse` right after the fields validate; a ValueError names the key and the fix.
The strategy's own rules come first (`Backend.check`), so a key the strategy refuses is named as such.
"""
from __future__ import annotations

from raytf import backends, learning_rate
from raytf.spec import JobSpec
from raytf.spec_optimizer import ScheduleSpec


def check(spec: JobSpec) -> None:
    backend = backends.get(spec.strategy)
    backend.check(spec)  # first: a key the strategy refuses is named as such
    if spec.train_fn is None:
        if spec.model is None:
            raise ValueError("model: missing; name the function that builds the model, e.g. model: digits:build_model")
        if (spec.data is None) == (spec.dataset_fn is None):
            raise ValueError("give exactly one of data (Parquet) or dataset_fn (module:function)")
        if spec.dataset_fn is not None and spec.train.steps_per_epoch is None:
            raise ValueError("train.steps_per_epoch: required with dataset_fn, so every worker runs the same "
                             "number of steps; e.g. train.steps_per_epoch: 100")
    if spec.data is not None:
        unknown = sorted(set(spec.data.fill_nulls) - {*spec.data.features, spec.data.label})
        if unknown:
            raise ValueError(f"data.fill_nulls: {unknown} are not among data.features or data.label")
        if spec.data.remainder == "pad" and spec.train.steps_per_epoch is not None:
            raise ValueError("data.remainder: pad reads every row once per epoch, so train.steps_per_epoch "
                             "must be null (or use remainder: drop)")
    elastic = spec.failure.elastic
    if elastic is not None and elastic.min_workers > spec.cluster.workers:
        raise ValueError(f"failure.elastic.min_workers {elastic.min_workers} is more than cluster.workers "
                         f"{spec.cluster.workers}; use at most {spec.cluster.workers}")
    if spec.train.keras == "legacy" and spec.train_fn is None:
        raise ValueError("train.keras: legacy runs a train_fn under tf.keras (Keras 2); raytf's own loop (model + "
                         "data) is Keras 3: remove train.keras, or give a train_fn")
    if spec.train_fn is not None:
        ours = [(spec.train.accumulation_steps > 1, "train.accumulation_steps"),
                (spec.optimizer.schedule != ScheduleSpec(), "optimizer.schedule"),
                (spec.optimizer.scale_lr is not None, "optimizer.scale_lr")]
        for given, key in ours:
            if given:
                raise ValueError(f"{key} is for raytf's loop (model + data); a train_fn runs its own steps and "
                                 f"optimizer: remove {key}, or use ctx.global_batch_size in the train_fn")
    if "saved_model" in spec.output.export and spec.data is None:
        raise ValueError("output.export: saved_model names the signature's inputs after data.features; it needs "
                         "data (Parquet), not dataset_fn; export keras only, or give data")
    profile, world = spec.output.profile, len(backend.roles(spec))
    if profile is not None and max(profile.ranks) >= world:
        raise ValueError(f"output.profile.ranks {profile.ranks}: the job has ranks 0..{world - 1}")
    warmup = spec.optimizer.schedule.warmup
    if warmup is not None and warmup.epochs is not None and warmup.epochs >= spec.train.epochs:
        raise ValueError(f"optimizer.schedule.warmup.epochs {warmup.epochs:g} is not shorter than train.epochs "
                         f"{spec.train.epochs}; warm up for a part of training, e.g. warmup: {{epochs: 1}}")
    if spec.train.deterministic:
        _check_deterministic(spec)
    if spec.train.steps_per_epoch is not None:
        learning_rate.in_steps(spec, spec.train.steps_per_epoch)  # a schedule longer than training names itself
    backend.check_batch(spec)


def _check_deterministic(spec: JobSpec) -> None:
    """What train.deterministic cannot make reproducible, each with the reason."""
    cannot = [
        (spec.failure.elastic is not None, "failure.elastic",
         "a restart with fewer workers splits the data and the batch differently"),
        (spec.data is not None and spec.data.cache != "none", f"data.cache: {spec.data.cache if spec.data else ''}",
         "a resumed run fills the cache in another order than the first pass"),
        (spec.dataset_fn is not None, "dataset_fn",
         "a resumed run reads your dataset from its start again; give data (Parquet)"),
    ]
    for bad, what, why in cannot:
        if bad:
            raise ValueError(f"train.deterministic: {what} cannot be reproduced: {why}")
