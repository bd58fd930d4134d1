"""The job spec: pydantic models (unknown keys are errors, frozen), YAML loading and `--set` overrides.

Everything a user can get wrong is found here, once, before any actor starts:
`parse` checks shapes and values (pure, no imports of user code), `load` also resolves paths
against the job file's folder and imports the named `module:function`s.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raytf.errors import SpecError, clip

FUNCTION_REF = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


_NUMBERS = (int, float, int | None, float | None)


class _Strict(BaseModel):
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


class DecodeSpec(_Strict):
    """An encoded-image column (binary) decoded to a uint8 [height, width, channels] tensor."""

    column: str
    format: Literal["jpeg", "png"]
    channels: Literal[1, 3, 4] = 3

    @model_validator(mode="after")
    def _channels_fit(self) -> "DecodeSpec":
        if self.format == "jpeg" and self.channels == 4:
            raise ValueError(f"data.decode: JPEG has no alpha channel; use channels: 3 (or 1) for {self.column!r}")
        return self


class DataSpec(_Strict):
    train: str
    validation: str | None = None
    features: list[str] = Field(min_length=1)
    label: str
    # Rows that do not fill the last global batch of an epoch: "drop" them (different ones each epoch,
    # as the order is reshuffled), or "pad" the batch with weight-0 rows so every row counts every epoch.
    remainder: Literal["drop", "pad"] = "drop"
    fill_nulls: dict[str, Union[float, int, str]] = Field(default_factory=dict)  # column -> value for nulls
    # Per example, inside tf.data (num_parallel_calls=AUTOTUNE, order kept): decode image columns, then
    # preprocess (module:function, TF ops only) maps the example dict (label included) to the dict the
    # model trains on. Validation uses preprocess_validation, else preprocess (with training=False when it
    # takes `training`). cache: keep the decoded rows in memory or on local disk after the first pass.
    decode: list[DecodeSpec] = Field(default_factory=list)
    preprocess: str | None = Field(default=None, pattern=FUNCTION_REF)
    preprocess_validation: str | None = Field(default=None, pattern=FUNCTION_REF)
    cache: Literal["none", "memory", "disk"] = "none"

    @field_validator("decode", mode="before")
    @classmethod
    def _decode_as_list(cls, value):
        return [value] if isinstance(value, Mapping) else value

    @model_validator(mode="after")
    def _examples_consistent(self) -> "DataSpec":
        for d in self.decode:
            if d.column not in self.features:
                raise ValueError(f"data.decode: column {d.column!r} is not among data.features {self.features}; "
                                 f"add it there")
        if len({d.column for d in self.decode}) < len(self.decode):
            raise ValueError("data.decode: a column is named twice")
        if self.preprocess_validation is not None and self.preprocess is None:
            raise ValueError("data.preprocess_validation needs data.preprocess (the training one)")
        if self.cache != "none" and self.remainder == "pad":
            raise ValueError("data.cache streams the cached rows pass after pass, which data.remainder: pad cannot "
                             "count per epoch; use remainder: drop with a cache, or cache: none")
        return self

    @property
    def per_example(self) -> bool:
        """Whether rows go through the per-example path (decode, preprocess, cache) instead of whole batches."""
        return bool(self.decode or self.preprocess or self.cache != "none")


class LossSpec(_Strict):
    name: str
    from_logits: bool = False


class Span(_Strict):
    """A length of training: in epochs (fractions allowed) or in optimizer steps."""

    epochs: float | None = Field(default=None, gt=0)
    steps: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_unit(self) -> "Span":
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("give epochs or steps (one of them), e.g. {epochs: 2} or {steps: 500}")
        return self

    def in_steps(self, steps_per_epoch: int) -> int:
        return self.steps if self.steps is not None else max(1, round(self.epochs * steps_per_epoch))


class WarmupSpec(Span):
    # The ramp starts at start_factor x the rate it leads to (Goyal et al. start from the unscaled rate:
    # start_factor = base_batch_size / effective batch).
    start_factor: float = Field(default=0.0, ge=0, lt=1)


class BoundariesSpec(_Strict):
    epochs: list[float] | None = None
    steps: list[int] | None = None

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


class ScheduleSpec(_Strict):
    """The learning rate over optimizer steps, from optimizer.learning_rate (after scale_lr): constant;
    cosine down to alpha x the rate (over `decay`, default the rest of training after warmup); step:
    x factor every `every`; exponential: x factor per `every` (staircase: in whole periods); piecewise:
    the rate x factors[i] from boundaries[i] on. An optional linear warmup leads into any of them."""

    name: Literal["constant", "cosine", "step", "exponential", "piecewise"] = "constant"
    warmup: WarmupSpec | None = None
    alpha: float | None = Field(default=None, ge=0, le=1)
    decay: Span | None = None
    every: Span | None = None
    factor: float | None = Field(default=None, gt=0)
    staircase: bool | None = None
    boundaries: BoundariesSpec | None = None
    factors: list[Annotated[float, Field(gt=0)]] | None = None

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


class ScaleLrSpec(_Strict):
    """The large-batch rule: learning_rate was tuned at base_batch_size; the job trains at its effective
    batch (train.global_batch_size x train.accumulation_steps) with the rate x ratio (linear, Goyal et
    al.) or x sqrt(ratio)."""

    rule: Literal["linear", "sqrt"]
    base_batch_size: int = Field(ge=1)


class OptimizerSpec(_Strict):
    name: str = "adam"
    learning_rate: float = Field(default=0.001, gt=0)  # the peak rate, at base_batch_size when scale_lr is set
    schedule: ScheduleSpec = ScheduleSpec()
    scale_lr: ScaleLrSpec | None = None
    options: dict[str, Any] = Field(default_factory=dict)  # other constructor arguments, e.g. momentum

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


class TrainSpec(_Strict):
    epochs: int = Field(default=1, ge=1)
    global_batch_size: int = Field(default=64, ge=1, le=2 ** 31 - 1)
    steps_per_epoch: int | None = Field(default=None, ge=1)
    seed: int = 0
    shuffle_buffer: int = Field(default=10_000, ge=0)
    # Mixed precision: 16-bit compute, float32 variables (mixed_float16 adds loss scaling). GPUs: float16
    # on V100/T4/A10, bfloat16 on A100/H100/TPU-class hardware.
    precision: Literal["float32", "mixed_float16", "mixed_bfloat16"] = "float32"
    jit_compile: bool = False  # XLA-compile each replica's forward and backward pass
    # Gradient accumulation: the optimizer steps once per K micro-batches of global_batch_size, so the
    # effective batch is global_batch_size x K at the memory of one micro-batch.
    accumulation_steps: int = Field(default=1, ge=1)
    # A train_fn's Keras: legacy runs it under tf.keras = tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1), whose
    # model.fit works under MultiWorkerMirrored. None: Keras 3, and a train_fn that calls .fit() is refused
    # (Keras 3's fit fails under MultiWorkerMirrored on TF 2.21); keras3: Keras 3, unchecked.
    keras: Literal["keras3", "legacy"] | None = None
    # A NaN or infinite epoch loss: stop the job (exit 1, nothing exported), or go on regardless.
    nonfinite_loss: Literal["stop", "continue"] = "stop"

    @property
    def effective_batch_size(self) -> int:
        return self.global_batch_size * self.accumulation_steps

    def describe_batch(self) -> str:
        """The effective batch as messages name it: "512 x 4 accumulation steps", or "64"."""
        if self.accumulation_steps > 1:
            return f"{self.global_batch_size} x {self.accumulation_steps} accumulation steps"
        return str(self.global_batch_size)


class ClusterSpec(_Strict):
    workers: int = Field(default=2, ge=1)
    cpus_per_worker: float = Field(default=1.0, ge=0)
    gpus_per_worker: float = Field(default=0.0, ge=0)
    # Custom Ray resources each worker asks for too, e.g. {spot: 1} to run only on the node types that
    # declare them (cluster.yaml's spot GPU nodes do).
    resources_per_worker: dict[str, float] = Field(default_factory=dict)
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    # per_gpu: one worker per GPU (gpus_per_worker <= 1, fractions share a GPU); per_node: one worker
    # per node using all gpus_per_worker GPUs of it (MirroredStrategy inside the node, collectives
    # across nodes), placed strict_spread. None: as the other keys say.
    gpu_placement: Literal["per_gpu", "per_node"] | None = None
    gpu_memory_growth: bool = True  # allocate GPU memory as needed, so fractional-GPU workers can share
    # MultiWorkerMirrored's collectives: auto (TensorFlow picks), ring (gRPC, any device) or nccl (GPUs only).
    communication: Literal["auto", "ring", "nccl"] = "auto"
    # A collective not done in this long fails (a dead or frozen peer) instead of blocking forever; the
    # hang watchdog (failure.hang_timeout_s) stays the backstop. None: TensorFlow's default, no timeout.
    collective_timeout_s: float | None = Field(default=None, gt=0)
    reserve_timeout_s: float = Field(default=60.0, gt=0)
    start_timeout_s: float = Field(default=120.0, gt=0)
    # strategy: parameter_server only. ps tasks hold the variables; the chief runs the coordinator; the
    # evaluator (optional) is a side-car that evaluates each checkpoint on the validation data.
    ps: int = Field(default=0, ge=0)
    cpus_per_ps: float = Field(default=1.0, ge=0)
    cpus_per_chief: float = Field(default=1.0, ge=0)
    evaluator: bool = False
    variable_partitioner: "PartitionerSpec | None" = None

    @model_validator(mode="after")
    def _gpu_placement(self) -> "ClusterSpec":
        if self.gpu_placement == "per_gpu" and not 0 < self.gpus_per_worker <= 1:
            raise ValueError(f"cluster.gpu_placement per_gpu needs 0 < gpus_per_worker <= 1, got "
                             f"{self.gpus_per_worker:g}; use gpu_placement: per_node for several GPUs per worker")
        if self.gpu_placement == "per_node" and (self.gpus_per_worker < 1 or self.gpus_per_worker % 1):
            raise ValueError(f"cluster.gpu_placement per_node needs gpus_per_worker = the GPUs of a node "
                             f"(a whole number >= 1), got {self.gpus_per_worker:g}")
        for name, amount in self.resources_per_worker.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"cluster.resources_per_worker: {name} is not a custom resource; use "
                                 f"cpus_per_worker / gpus_per_worker" if name in ("CPU", "GPU") else
                                 f"cluster.resources_per_worker: {name} is not a custom resource; leave it out")
            if not amount > 0:
                raise ValueError(f"cluster.resources_per_worker: {name}: {amount} must be > 0")
        return self

    @property
    def effective_placement(self) -> str:
        return "strict_spread" if self.gpu_placement == "per_node" else self.placement

    @property
    def replicas_per_worker(self) -> int:
        """MultiWorkerMirrored makes one replica per visible GPU, or one on CPU."""
        return max(1, int(self.gpus_per_worker))

    @property
    def replicas(self) -> int:
        return self.workers * self.replicas_per_worker


class PartitionerSpec(_Strict):
    """How variables are split over the ps tasks (TF's variable_partitioner). min_size: shards of at least
    min_shard_bytes, at most one per ps task (small variables stay whole); fixed: `shards` shards each."""

    kind: Literal["min_size", "fixed"] = "min_size"
    min_shard_bytes: int = Field(default=256 << 10, ge=1)
    shards: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _shards_for_fixed(self) -> "PartitionerSpec":
        if self.kind == "fixed" and self.shards is None:
            raise ValueError("cluster.variable_partitioner: kind fixed needs shards (e.g. shards: 2)")
        if self.kind == "min_size" and self.shards is not None:
            raise ValueError("cluster.variable_partitioner: shards is for kind: fixed; min_size uses min_shard_bytes")
        return self


ClusterSpec.model_rebuild()


class ElasticSpec(_Strict):
    min_workers: int = Field(ge=1)


class FailureSpec(_Strict):
    # With no step from any rank for this long, the attempt is declared hung and torn down.
    hang_timeout_s: float = Field(default=300.0, gt=0)
    # Restarts after a worker or node dies, hangs or loses its network: from the latest checkpoint,
    # or from the start when checkpoint.dir is not set.
    max_restarts: int = Field(default=0, ge=0)
    # When the cluster cannot give back all workers after a failure, go on with fewer (>= min_workers).
    elastic: ElasticSpec | None = None
    # With max_restarts > 0 (mirrored): once training runs, keep one warm process per worker with
    # TensorFlow imported, so a restart promotes them instead of starting new ones.
    standby: bool = True
    # When Ray marks a node of the job as draining (a spot instance reclaimed, `ray drain-node`), every
    # worker stops at one common step, the job checkpoints there and restarts without the node, free of
    # failure.max_restarts. Needs checkpoint.dir; false: carry on until the node goes.
    preemption: bool = True


class CheckpointSpec(_Strict):
    dir: str | None = None  # a local directory (shared by all nodes) or a pyarrow.fs URI; None: no checkpoints
    every_steps: int | None = Field(default=None, ge=1)
    every_epochs: int | None = Field(default=None, ge=1)
    keep: int = Field(default=3, ge=1)

    @model_validator(mode="after")
    def _one_interval(self) -> "CheckpointSpec":
        if self.every_steps is not None and self.every_epochs is not None:
            raise ValueError("checkpoint: give every_steps or every_epochs, not both")
        return self

    @property
    def interval(self) -> tuple[str, int]:
        if self.every_steps is not None:
            return "steps", self.every_steps
        return "epochs", self.every_epochs or 1


class ProfileSpec(_Strict):
    """A tf.profiler trace of optimizer steps first..last (1-based, inclusive) on the given ranks."""

    steps: tuple[int, int]
    ranks: list[int] = Field(default_factory=lambda: [0], min_length=1)

    @model_validator(mode="after")
    def _order(self) -> "ProfileSpec":
        first, last = self.steps
        if not 1 <= first <= last:
            raise ValueError(f"steps [{first}, {last}]: give [first, last] optimizer steps, 1 <= first <= last, "
                             f"e.g. steps: [10, 20]")
        if any(r < 0 for r in self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ranks {self.ranks}: distinct ranks >= 0, e.g. ranks: [0]")
        return self


class OutputSpec(_Strict):
    dir: str | None = Field(default=None, min_length=1)  # default: runs/<name>, next to the job file
    tensorboard: bool = True
    # keras: model.keras; saved_model: a TensorFlow SavedModel for TF Serving, at saved_model/
    export: list[Literal["keras", "saved_model"]] = Field(default_factory=lambda: ["keras"], min_length=1)
    profile: ProfileSpec | None = None  # a tf.profiler trace, into tensorboard/ for TensorBoard's profile plugin
    # Each worker's input wait and step time, measured in its steps; stragglers named. Its cost is below
    # what a run-to-run comparison resolves (benchmarks/bench_timing.py: BENCHMARKS.md, "Per-worker timing").
    timing: bool = True


class JobSpec(_Strict):
    name: str = Field(pattern=r"^[\w.-]+$", max_length=100)
    # The job folder: relative paths and module:function names resolve against it, and it travels to
    # every actor. Default: the job file's folder; a relative base_dir is relative to that folder.
    base_dir: str | None = None
    strategy: Literal["mirrored", "parameter_server"] = "mirrored"
    model: str | None = Field(default=None, pattern=FUNCTION_REF)
    data: DataSpec | None = None
    dataset_fn: str | None = Field(default=None, pattern=FUNCTION_REF)
    train_fn: str | None = Field(default=None, pattern=FUNCTION_REF)
    # Free-form settings for the job's own code (a train_fn's hyperparameters, as Ray Train's
    # train_loop_config): ctx.config in the train_fn; a sweep's space may set config.<key> like any key.
    config: dict[str, Any] = Field(default_factory=dict)
    loss: Union[str, LossSpec] = Field(default="sparse_categorical_crossentropy", validate_default=True)
    optimizer: OptimizerSpec = OptimizerSpec()
    metrics: list[str] = Field(default_factory=list)
    train: TrainSpec = TrainSpec()
    cluster: ClusterSpec = ClusterSpec()
    failure: FailureSpec = FailureSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    output: OutputSpec = OutputSpec()

    @field_validator("loss")
    @classmethod
    def _loss_as_spec(cls, value: Union[str, LossSpec]) -> LossSpec:
        return LossSpec(name=value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> "JobSpec":
        from raytf import backends

        backend = backends.get(self.strategy)
        backend.check(self)  # first: a key the strategy refuses is named as such
        if self.train_fn is None:
            if self.model is None:
                raise ValueError("model: missing; name the function that builds the model, e.g. model: digits:build_model")
            if (self.data is None) == (self.dataset_fn is None):
                raise ValueError("give exactly one of data (Parquet) or dataset_fn (module:function)")
            if self.dataset_fn is not None and self.train.steps_per_epoch is None:
                raise ValueError("train.steps_per_epoch: required with dataset_fn, so every worker runs the same "
                                 "number of steps; e.g. train.steps_per_epoch: 100")
        if self.data is not None:
            unknown = sorted(set(self.data.fill_nulls) - {*self.data.features, self.data.label})
            if unknown:
                raise ValueError(f"data.fill_nulls: {unknown} are not among data.features or data.label")
            if self.data.remainder == "pad" and self.train.steps_per_epoch is not None:
                raise ValueError("data.remainder: pad reads every row once per epoch, so train.steps_per_epoch "
                                 "must be null (or use remainder: drop)")
        elastic = self.failure.elastic
        if elastic is not None and elastic.min_workers > self.cluster.workers:
            raise ValueError(f"failure.elastic.min_workers {elastic.min_workers} is more than cluster.workers "
                             f"{self.cluster.workers}; use at most {self.cluster.workers}")
        if self.train.keras == "legacy" and self.train_fn is None:
            raise ValueError("train.keras: legacy runs a train_fn under tf.keras (Keras 2); raytf's own loop (model + "
                             "data) is Keras 3: remove train.keras, or give a train_fn")
        if self.train_fn is not None:
            ours = [(self.train.accumulation_steps > 1, "train.accumulation_steps"),
                    (self.optimizer.schedule != ScheduleSpec(), "optimizer.schedule"),
                    (self.optimizer.scale_lr is not None, "optimizer.scale_lr")]
            for given, key in ours:
                if given:
                    raise ValueError(f"{key} is for raytf's loop (model + data); a train_fn runs its own steps and "
                                     f"optimizer: remove {key}, or use ctx.global_batch_size in the train_fn")
        if "saved_model" in self.output.export and self.data is None:
            raise ValueError("output.export: saved_model names the signature's inputs after data.features; it needs "
                             "data (Parquet), not dataset_fn; export keras only, or give data")
        profile = self.output.profile
        if profile is not None:
            world = self.cluster.workers + (1 if self.strategy == "parameter_server" else 0)
            if self.strategy == "parameter_server" and profile.ranks != [0]:
                raise ValueError(f"output.profile.ranks {profile.ranks}: under parameter_server only the chief "
                                 f"(rank 0) runs the loop and is traced; use ranks: [0]")
            if max(profile.ranks) >= world:
                raise ValueError(f"output.profile.ranks {profile.ranks}: the job has ranks 0..{world - 1}")
        warmup = self.optimizer.schedule.warmup
        if warmup is not None and warmup.epochs is not None and warmup.epochs >= self.train.epochs:
            raise ValueError(f"optimizer.schedule.warmup.epochs {warmup.epochs:g} is not shorter than train.epochs "
                             f"{self.train.epochs}; warm up for a part of training, e.g. warmup: {{epochs: 1}}")
        if self.train.steps_per_epoch is not None:
            from raytf import learning_rate

            learning_rate.plan(self, self.train.steps_per_epoch)  # a schedule longer than training names itself
        backend.check_batch(self)
        return self


@dataclasses.dataclass(frozen=True)
class Job:
    """A validated spec plus where it came from: the folder its relative paths and modules resolve against."""

    spec: JobSpec
    job_dir: Path
    source: str | None = None  # the YAML path, for messages
    datasets: dict = dataclasses.field(default_factory=dict)  # split -> data.DatasetInfo, read once by load

    @property
    def checkpoint_dir(self) -> str | None:
        """checkpoint.dir as every process must see it: URIs as they are, relative paths under the job folder."""
        location = self.spec.checkpoint.dir
        return None if location is None else self.data_path(location)

    @property
    def output_dir(self) -> Path:
        out = self.spec.output.dir or f"runs/{self.spec.name}"
        return _resolve(self.job_dir, out)

    def data_path(self, path: str) -> str:
        """A data path as the driver sees it: URIs as they are, relative paths under the job folder."""
        return path if "://" in path else str(_resolve(self.job_dir, path))

    def actor_data_path(self, path: str) -> str:
        """A data path as an actor sees it. The job folder travels as the actor's working directory,
        so paths inside it stay relative; paths outside it must be reachable from every node."""
        if "://" in path:
            return path
        resolved = _resolve(self.job_dir, path)
        try:
            return str(resolved.relative_to(self.job_dir))
        except ValueError:
            return str(resolved)


def _resolve(base: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


# ---------------------------------------------------------------- parsing


def parse(raw: Mapping[str, Any], source: str = "job spec") -> JobSpec:
    """Validate a plain mapping into a JobSpec. Pure: imports no user code."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"{source}: expected a mapping of sections (name, model, data, ...), got {type(raw).__name__}")
    try:
        return JobSpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise SpecError(_describe_validation_error(exc, source)) from None


def _describe_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-after", "union")))
        where = where.replace(".LossSpec", "").replace(".str", "")
        if err["type"] == "extra_forbidden":
            known = _known_keys(err["loc"][:-1])
            lines.append(f"{where}: unknown key; known keys here: {', '.join(known)}")
        elif err["type"] == "missing":
            lines.append(f"{where}: missing; add it to the spec")
        elif err["type"] == "value_error":
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" if where and not msg.startswith(f"{where}.") else msg)  # no "data: data.x"
        elif err["type"] == "string_pattern_mismatch" and where in FUNCTION_KEYS:
            lines.append(f"{where}: {clip(repr(err['input']))} is not a module:function name; write e.g. "
                         f"digits:build_model")
        elif err["type"] == "literal_error":
            lines.append(f"{where}: {clip(repr(err['input']))} is not one of {err['ctx']['expected']}")
        else:
            lines.append(f"{where}: {err['msg'].lower()} (got {clip(repr(err['input']))})")
    # Union members repeat the same complaint; keep the first of each.
    unique = list(dict.fromkeys(lines))
    return f"{source}: " + "; ".join(unique)


def _known_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            break
        candidates = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                      if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            break
        model = candidates[0]
    return list(model.model_fields)


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-copy `raw` and set each dotted key (`train.epochs`) to its value."""
    out = copy.deepcopy(dict(raw))
    for dotted, value in overrides.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError(f"--set {dotted}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def parse_set_options(items: list[str]) -> dict[str, Any]:
    """`["train.epochs=3", "cluster.placement=spread"]` -> {dotted: YAML-typed value}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.epochs=3")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def read_yaml(path: Path) -> dict[str, Any]:
    from raytf import yaml_file

    raw = yaml_file.read(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping of sections (name, model, data, ...)")
    return raw


# ---------------------------------------------------------------- loading


def load(source: "str | Path | Mapping[str, Any] | JobSpec | Job",
         overrides: Mapping[str, Any] | None = None,
         check_data: bool = True, check_code: bool = True) -> Job:
    """Load, override, validate and resolve a job: the one place a spec is checked.

    The checks that need no TensorFlow come first (shape, paths, modules found, checkpoint dir, data,
    divisibility), so a spec wrong in those ways fails in a fraction of an `import tensorflow`; only then
    are the named functions imported and the Keras names checked (`check_code`: `check_job_code`)."""
    overrides = dict(overrides or {})
    if isinstance(source, Job):
        if not overrides:
            return source
        raw, start, name = source.spec.model_dump(), None, source.source
    elif isinstance(source, JobSpec):
        raw, start, name = source.model_dump(), Path.cwd(), "job spec"
    elif isinstance(source, Mapping):
        raw, start, name = dict(source), Path.cwd(), "job spec"
    else:
        path = Path(source).expanduser().resolve()
        raw, start, name = read_yaml(path), path.parent, str(source)
    spec = parse(apply_overrides(raw, overrides), name)
    job_dir = source.job_dir if start is None else job_folder(spec, start, name)
    for key in FUNCTION_KEYS:
        ref = function_ref(spec, key)
        if ref is not None:
            find_module(ref, job_dir, key)
    if spec.train_fn is not None:
        check_train_fn_keras(spec, job_dir)
    job = Job(spec=spec, job_dir=job_dir, source=name)
    if job.checkpoint_dir is not None:
        from raytf.checkpoint import Storage

        Storage(job.checkpoint_dir).check_writable()
    if check_data and spec.data is not None:
        from raytf import data  # pyarrow only; no TensorFlow

        for split in ("train", "validation"):
            path = getattr(spec.data, split)
            if path is not None:
                job.datasets[split] = data.describe(job.data_path(path), spec.data.features, spec.data.label,
                                                    key=f"data.{split}", fill_nulls=spec.data.fill_nulls)
                data.check_images(job.datasets[split], spec.data.decode, key=f"data.{split}")
        check_labels(spec, job.datasets)
        undecoded = [c.name for c in job.datasets["train"].features
                     if c.dtype == "bytes" and c.name not in {d.column for d in spec.data.decode}]
        if undecoded and spec.data.preprocess is None:
            raise SpecError(f"data.features: {undecoded} are binary (e.g. encoded images) and would reach the model "
                            f"as raw bytes; decode them with data.decode: {{column: {undecoded[0]}, format: png|jpeg}} "
                            f"or in data.preprocess")
        validation = job.datasets.get("validation")
        if validation is not None and spec.data.per_example and validation.num_rows < spec.cluster.workers:
            raise SpecError(f"data.validation has {validation.num_rows} rows, fewer than cluster.workers "
                            f"{spec.cluster.workers}; with data.decode/preprocess every worker needs a real row to "
                            f"pad its validation batches with: use more validation rows or fewer workers")
        rows = job.datasets["train"].num_rows
        if rows < spec.cluster.workers:  # some worker would get no rows (under mirrored the batch check catches it)
            raise SpecError(f"data.train has {rows} rows, fewer than cluster.workers {spec.cluster.workers}: some "
                            f"workers would have nothing to read; use at most {rows} workers")
        batch = spec.train.effective_batch_size
        if spec.train.steps_per_epoch is None and rows < batch and spec.data.remainder == "drop":
            raise SpecError(f"{name}: data.train has {rows} rows, fewer than one global batch of "
                            f"{spec.train.describe_batch()}; lower "
                            f"train.global_batch_size (or use data.remainder: pad)")
        if spec.train.steps_per_epoch is None and rows >= batch:
            from raytf import learning_rate

            try:  # the schedule against the steps the rows make (data.remainder: pad may add one)
                learning_rate.plan(spec, rows // batch)
            except ValueError as exc:
                raise SpecError(f"{name}: {exc}") from None
    if check_code:
        check_job_code(job)
    return job


FUNCTION_KEYS = ("model", "dataset_fn", "train_fn", "data.preprocess", "data.preprocess_validation")


def function_ref(spec: JobSpec, key: str) -> str | None:
    """The module:function a FUNCTION_KEYS key names in `spec` (None: not set)."""
    section, _, name = key.rpartition(".")
    holder = getattr(spec, section) if section else spec
    return getattr(holder, name) if holder is not None else None


def check_job_code(job: Job) -> None:
    """The checks that import the job's code (and with it, usually, TensorFlow): each named function
    exists and is callable; the loss, optimizer and metric names are Keras's."""
    for key in FUNCTION_KEYS:
        ref = function_ref(job.spec, key)
        if ref is not None:
            func = resolve_function(ref, job.job_dir, key)
            if key == "train_fn":
                _check_takes_ctx(ref, func)
    _check_keras_names(job.spec)
    if job.spec.model is not None:
        from raytf.model_check import model_output_shape

        output = model_output_shape(job.spec, job.job_dir, resolve_function(job.spec.model, job.job_dir, "model"))
        if output is not None:
            check_labels(job.spec, job.datasets, output)


def _check_takes_ctx(ref: str, func) -> None:
    """raytf calls a train_fn with one argument, the ctx."""
    import inspect

    try:
        inspect.signature(func).bind(object())
    except TypeError:
        raise SpecError(f"train_fn: {ref} takes {inspect.signature(func)}, but raytf calls it with one argument, the "
                        f"ctx: def {ref.partition(':')[2]}(ctx)") from None
    except ValueError:  # no signature to read (a builtin): left to the call
        pass


LEGACY_INSTALL = "pip install 'raytf[legacy]'"  # tf-keras==2.21.*


def check_train_fn_keras(spec: JobSpec, job_dir: Path) -> None:
    """Before any actor starts: train.keras: legacy needs tf-keras installed, and a train_fn that calls
    .fit() under Keras 3 would fail inside every worker (TF 2.21's MultiWorkerMirrored and Keras 3's fit do
    not work together), so it is refused with the way out. Reads the source; imports nothing."""
    if spec.train.keras == "legacy":
        if importlib.util.find_spec("tf_keras") is None:
            raise SpecError(f"train.keras: legacy needs tf-keras (Keras 2), which is not installed; {LEGACY_INSTALL} "
                            f"(or pip install tf-keras==2.21.*)")
        return
    if spec.train.keras is not None:  # keras3, said explicitly: the user knows what the function does
        return
    module_name, _, func_name = spec.train_fn.partition(":")
    source = module_source(module_name, job_dir)
    lines = fit_calls(source, func_name) if source is not None else []
    if lines and spec.strategy == "parameter_server":
        # Keras 3's fit has no ClusterCoordinator path: TF runs its steps on the chief itself, none on a worker.
        raise SpecError(f"train_fn {spec.train_fn} calls .fit() (line {lines[0]}): Keras 3's model.fit does not "
                        f"drive ParameterServerStrategy's ClusterCoordinator (every step would run on the chief, "
                        f"none on the workers); run it under "
                        f"tf.keras with train.keras: legacy (tf-keras: {LEGACY_INSTALL}), write the loop with "
                        f"ctx.coordinator.schedule, or use raytf's loop (model + data). If this .fit() is not a "
                        f"Keras model's, set train.keras: keras3")
    if lines:
        raise SpecError(f"train_fn {spec.train_fn} calls .fit() (line {lines[0]}): Keras 3's model.fit fails under "
                        f"MultiWorkerMirroredStrategy on TensorFlow 2.21; run it under tf.keras with train.keras: "
                        f"legacy (tf-keras: {LEGACY_INSTALL}), write the loop with strategy.run, or use raytf's loop "
                        f"(model + data). If this .fit() is not a Keras model's, set train.keras: keras3")


def module_source(module_name: str, job_dir: Path) -> str | None:
    """The text of a module's file, found as find_module finds it, without importing it."""
    root = code_root(module_name, job_dir)
    path = None
    if root is not None:
        candidate = root.joinpath(*module_name.split("."))
        path = candidate.with_suffix(".py") if candidate.with_suffix(".py").is_file() else candidate / "__init__.py"
    else:
        try:
            found = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            found = None
        path = Path(found.origin) if found is not None and found.origin else None
    return path.read_text() if path is not None and path.is_file() else None


def fit_calls(source: str, func_name: str) -> list[int]:
    """The lines where function `func_name` of `source`, or a function of the same module it calls (a
    `train(ctx)` wrapping Ray Train's `train_func(config)`), calls `<something>.fit(...)`."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # the import reports it
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    lines, seen, todo = set(), set(), [func_name]
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for call in ast.walk(functions[name]):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "fit":
                lines.add(call.lineno)
            elif isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                todo.append(call.func.id)
    return sorted(lines)


def job_folder(spec: JobSpec, start: Path, source: str = "job spec") -> Path:
    """The job folder: base_dir resolved against `start` (the job file's folder), else `start`."""
    if spec.base_dir is None:
        return start
    folder = _resolve(start, spec.base_dir)
    if not folder.is_dir():
        raise SpecError(f"{source}: base_dir {spec.base_dir!r} ({folder}) is not a folder; point it at the folder "
                        f"that holds the job's code and data, or remove it")
    return folder


def code_root(module: str, job_dir: Path) -> Path | None:
    """Where `module` is found: the job folder first, then the working directory; None if installed."""
    top = module.split(".")[0]
    for root in (job_dir, Path.cwd()):
        if (root / f"{top}.py").is_file() or (root / top).is_dir():
            return root
    return None


def modules_outside(job_dir: Path, refs: list[str | None]) -> list[str]:
    """The top-level modules of `module:function` refs that are found in the working directory but not
    in the job folder: they must travel to the cluster as py_modules (the job folder travels anyway)."""
    paths = set()
    for ref in refs:
        if ref is None:
            continue
        top = ref.partition(":")[0].split(".")[0]
        root = code_root(top, job_dir)
        if root is not None and root != job_dir:
            paths.add(str(root / top) if (root / top).is_dir() else str(root / f"{top}.py"))
    return sorted(paths)


def _module_not_found(key: str, module_name: str, job_dir: Path) -> SpecError:
    return SpecError(f"{key}: module {module_name!r} not found in {job_dir} or {Path.cwd()}; "
                     f"put {module_name.replace('.', '/')}.py next to the job file")


def _on_path(module_name: str, job_dir: Path) -> None:
    """Make `module_name` import from its code root (the job folder, or the working directory). A module
    of that name imported earlier from another folder (another job in this process, e.g. a notebook's
    second job) is dropped first, or its functions would be checked in place of this job's."""
    root = code_root(module_name, job_dir)
    if root is None:
        return
    top = module_name.split(".")[0]
    loaded = sys.modules.get(top)
    where = getattr(loaded, "__file__", None)
    if loaded is not None and (where is None or Path(where).resolve().parent not in (root.resolve(), (root / top).resolve())):
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))


def find_module(ref: str, job_dir: Path, key: str = "model") -> None:
    """Whether `module:function`'s module can be found (job folder, working directory, installed),
    without running it: importing it usually imports TensorFlow, seconds that a typo should not cost."""
    module_name = ref.partition(":")[0]
    if code_root(module_name, job_dir) is not None:
        return
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package that is missing or fails to import
        found = None
    if found is None:
        raise _module_not_found(key, module_name, job_dir)


def resolve_function(ref: str, job_dir: Path, key: str = "model"):
    """Import `module:function` (job folder, then working directory, then installed) and return it."""
    module_name, _, func_name = ref.partition(":")
    _on_path(module_name, job_dir)
    bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ left in the user's job folder by the driver
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise _module_not_found(key, module_name, job_dir) from None
        raise SpecError(f"{key}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # the user's module raised while importing
        raise SpecError(f"{key}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    finally:
        sys.dont_write_bytecode = bytecode
    func = getattr(module, func_name, None)
    if func is None:
        raise SpecError(f"{key}: {module_name!r} has no function {func_name!r}; "
                        f"define it or fix the name in {ref!r}")
    if not callable(func):
        raise SpecError(f"{key}: {ref!r} is a {type(func).__name__}, not a function")
    return func


def _check_keras_names(spec: JobSpec) -> None:
    """Unknown loss/optimizer/metric names fail here, not inside an actor."""
    if spec.train_fn is not None:
        return
    import keras

    try:
        keras.losses.get(spec.loss.name)
    except ValueError:
        raise SpecError(f"loss: unknown Keras loss {spec.loss.name!r}; e.g. sparse_categorical_crossentropy, mse") from None
    try:
        keras.optimizers.get({"class_name": spec.optimizer.name,
                              "config": {"learning_rate": spec.optimizer.learning_rate, **spec.optimizer.options}})
    except (ValueError, TypeError) as exc:
        raise SpecError(f"optimizer: cannot build {spec.optimizer.name!r} with "
                        f"{dict(spec.optimizer.options)}: {exc}; e.g. optimizer: {{name: adam, learning_rate: 0.001}}") from None
    for name in spec.metrics:
        try:
            keras.metrics.get(name)
        except ValueError:
            raise SpecError(f"metrics: unknown Keras metric {name!r}; e.g. accuracy, mae") from None


# ---------------------------------------------------------------- labels against the loss (pure: no TensorFlow)

SPARSE_LOSSES = {"sparse_categorical_crossentropy"}  # a class id per row (per position); output: + a classes axis
ONE_HOT_LOSSES = {"categorical_crossentropy", "categorical_focal_crossentropy", "categorical_hinge"}
# Keras losses whose label has the output's shape (per row; a scalar label matches an output of width 1)
SAME_SHAPE_LOSSES = ONE_HOT_LOSSES | {
    "mean_squared_error", "mse", "mean_absolute_error", "mae", "mean_absolute_percentage_error", "mape",
    "mean_squared_logarithmic_error", "msle", "huber", "log_cosh", "logcosh", "binary_crossentropy",
    "binary_focal_crossentropy", "kl_divergence", "kld", "kullback_leibler_divergence", "poisson", "hinge",
    "squared_hinge", "cosine_similarity"}


class LabelShapeError(SpecError):
    """A label the loss (or the model's output) cannot take. Raised inside a traced step too, where AutoGraph
    would rewrap it (as a StagingError, "in user code:" and a stack); `ag_pass_through` keeps the one line."""

    ag_pass_through = True


def loss_key(name: str) -> str:
    """A Keras loss name as snake case: CategoricalCrossentropy and categorical_crossentropy are one loss."""
    import re

    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def describe_label(shape: tuple) -> str:
    shape = tuple(shape)
    if not shape:
        return "one number per row"
    if len(shape) == 1:
        return f"a vector of {shape[0]} numbers per row"
    return f"a tensor {list(shape)} per row"


def check_label_shape(loss: str, label: str | None, label_shape: tuple, output_shape: tuple | None = None,
                      values: str = "") -> None:
    """A label's per-row shape against the loss (and, when known, the model's per-row output shape);
    SpecError naming the label's shape and the loss that fits. `values`: "integer" | "float" | "" (unknown),
    the kind of numbers stored: a vector of floats with the sparse loss is taken for one-hot without the model.
    Unknown dimensions (None) are not checked."""
    key, name = loss_key(loss), f"label {label!r}" if label else "the label"
    label_shape = tuple(label_shape)
    words = describe_label(label_shape)
    if key in ONE_HOT_LOSSES and not label_shape:
        raise LabelShapeError(f"loss: {loss} takes one-hot label vectors, but {name} is {words} (a class id?); "
                              f"use loss: sparse_categorical_crossentropy, or write the label one-hot as a "
                              f"fixed-size list (keras.utils.to_categorical)")
    if output_shape is not None:
        output_shape = tuple(output_shape)
        if None in label_shape or None in output_shape:
            return
        if key in SAME_SHAPE_LOSSES and label_shape == output_shape[:-1] and output_shape[-1:] == (1,):
            label_shape = output_shape  # (batch,) against (batch, 1): raytf gives the label the output's rank
    if key in SPARSE_LOSSES and label_shape and (
            (output_shape == label_shape and label_shape[-1] != 1)
            or (output_shape is None and len(label_shape) == 1 and values == "float")):
        raise LabelShapeError(f"loss: {loss} takes one class id per row, but {name} is {words} (one-hot?); use "
                              f"loss: categorical_crossentropy (or write the class id, the vector's argmax)")
    if output_shape is None:
        return
    if key in SPARSE_LOSSES and label_shape not in (output_shape[:-1], output_shape[:-1] + (1,)):
        raise LabelShapeError(f"loss: {loss} needs the model's output to be the label's shape plus a last axis of "
                              f"classes, but {name} is {words} and the model outputs {describe_label(output_shape)}")
    if key in SAME_SHAPE_LOSSES and label_shape != output_shape:
        wide = f"; make the model's last layer {label_shape[0]} wide" if len(label_shape) == 1 else ""
        raise LabelShapeError(f"loss: {loss} needs a label of the model's output shape, but {name} is {words} and "
                              f"the model outputs {describe_label(output_shape)}{wide} (or fix the label)")


def check_labels(spec: JobSpec, datasets: Mapping[str, Any], output_shape: tuple | None = None) -> None:
    """At load, from the Parquet metadata: the label's shape against the loss (raytf's loop; a preprocess
    may reshape the label, then the check waits for the first step), and validation's label like train's.
    `output_shape`: the model's per-row output shape (model.output_shape[1:]), when the driver built it."""
    train, validation = datasets.get("train"), datasets.get("validation")
    if train is None or spec.train_fn is not None:
        return
    label = train.label
    if validation is not None and validation.label.shape != label.shape:
        raise SpecError(f"data.validation: label {label.name!r} is {describe_label(validation.label.shape)}, but "
                        f"{describe_label(label.shape)} in data.train; write both with one shape")
    if spec.data.preprocess is None and spec.data.preprocess_validation is None:
        check_label_shape(spec.loss.name, label.name, label.shape, output_shape, values=label.values)
