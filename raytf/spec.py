"""The job spec as data: pydantic models (unknown keys are errors, frozen), each field checked on its own.
`JobSpec` and its sections; the `optimizer:` section's models are `raytf.spec_optimizer`.

Pure: no strategy backends, no Keras, no user code. Rules across sections and strategies are
`raytf.spec_rules`; reading a job file, `--set` overrides and resolving paths and functions is `raytf.job`.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Mapping, Union

from pydantic import Field, field_validator, model_validator

from raytf.spec_optimizer import OptimizerSpec
from raytf.spec_strict import StrictModel

FUNCTION_REF = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class DecodeSpec(StrictModel):
    """An encoded-image column (binary) decoded to a uint8 [height, width, channels] tensor."""

    column: str = Field(description="The binary column holding the encoded images; it must be one of data.features.")
    format: Literal["jpeg", "png"] = Field(description=(
        "The images' encoding; checked against the first image's header before any actor starts."))
    channels: Literal[1, 3, 4] = Field(default=3, description=(
        "Channels after decoding (JPEG has no alpha channel, so 4 is PNG only)."))

    @model_validator(mode="after")
    def _channels_fit(self) -> "DecodeSpec":
        if self.format == "jpeg" and self.channels == 4:
            raise ValueError(f"data.decode: JPEG has no alpha channel; use channels: 3 (or 1) for {self.column!r}")
        return self


def _storage_uri(value: str | None) -> str | None:
    """A storage URI with no bucket, or with credentials in it, is refused (raytf.storage.uri_problem)."""
    from raytf.storage import uri_problem

    problem = uri_problem(value) if value is not None else None
    if problem:
        raise ValueError(f"the URI {problem}")
    return value


class DataSpec(StrictModel):
    train: str = Field(description=(
        "The training rows: a Parquet file, a directory of them (searched recursively), a glob, or a pyarrow.fs URI "
        "(s3://, gs://, hdfs://). Relative paths resolve against the job folder."))
    validation: str | None = Field(default=None, description=(
        "The validation rows, as for train; evaluated every epoch, every row once. None: no validation."))
    features: list[str] = Field(min_length=1, description=(
        "The feature columns; with more than one, the model receives a dict by column name. A list column is a "
        "vector feature."))
    label: str = Field(description=(
        "The label column: a number per row, or a fixed-size list of numbers (one-hot, multi-output)."))
    remainder: Literal["drop", "pad"] = Field(default="drop", description=(
        "Rows that do not fill the last global batch of an epoch: drop them (different ones each epoch, as the order "
        "is reshuffled), or pad the batch with weight-0 rows so every row counts every epoch."))
    fill_nulls: dict[str, Union[float, int, str]] = Field(default_factory=dict, description=(
        "Column -> the value its nulls become; without one, a column with nulls is an error."))
    decode: list[DecodeSpec] = Field(default_factory=list, description=(
        "Encoded-image columns to decode into uint8 [height, width, channels] tensors, per example inside tf.data (a "
        "single mapping is taken as a list of one)."))
    _uris = field_validator("train", "validation")(classmethod(lambda cls, v: _storage_uri(v)))
    preprocess: str | None = Field(default=None, pattern=FUNCTION_REF, description=(
        "A module:function (TF ops only) mapping each example dict, label included, to the dict the model trains on; "
        "inside tf.data, num_parallel_calls=AUTOTUNE, order kept. It may take `training` and `seed`."))
    preprocess_validation: str | None = Field(default=None, pattern=FUNCTION_REF, description=(
        "The validation rows' preprocess function. None: preprocess, with training=False when it takes `training`."))
    cache: Literal["none", "memory", "disk"] = Field(default="none", description=(
        "Keep the decoded rows (before preprocess) in memory or on local disk after the first pass."))

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


class LossSpec(StrictModel):
    name: str = Field(description="A Keras loss name, e.g. sparse_categorical_crossentropy.")
    from_logits: bool = Field(default=False, description=(
        "Whether the model's output is logits rather than probabilities."))


# What train.keras: legacy needs installed: the driver's check (raytf.job_code) and a worker's error say it alike.
LEGACY_INSTALL = "pip install 'raytf[legacy]'"  # tf-keras==2.21.*


class TrainSpec(StrictModel):
    epochs: int = Field(default=1, ge=1, description="Epochs to train.")
    global_batch_size: int = Field(default=64, ge=1, le=2 ** 31 - 1, description=(
        "Rows per step over all replicas (per replica x replicas); must divide by the replicas."))
    steps_per_epoch: int | None = Field(default=None, ge=1, description=(
        "Steps per epoch. None: rows // global_batch_size (from the Parquet metadata). Required with dataset_fn."))
    seed: int = Field(default=0, description=(
        "Seeds Python, NumPy and TensorFlow on every worker (raytf's loop and a train_fn alike), the data's "
        "shuffling and the per-example preprocess seeds."))
    shuffle_buffer: int = Field(default=10_000, ge=0, description=(
        "Rows shuffled together, in windows, as each worker streams its shard."))
    precision: Literal["float32", "mixed_float16", "mixed_bfloat16"] = Field(default="float32", description=(
        "float32, or 16-bit compute with float32 variables (mixed_float16 adds loss scaling). GPUs: float16 on "
        "V100/T4/A10, bfloat16 on A100/H100/TPU-class hardware."))
    jit_compile: bool = Field(default=False, description=(
        "XLA-compile each replica's forward and backward pass (the all-reduce stays outside). Not under "
        "parameter_server."))
    accumulation_steps: int = Field(default=1, ge=1, description=(
        "Gradient accumulation: the optimizer steps once per K micro-batches of global_batch_size, so the effective "
        "batch is global_batch_size x K at the memory of one micro-batch."))
    keras: Literal["keras3", "legacy"] | None = Field(default=None, description=(
        "A train_fn's Keras. legacy: tf.keras = tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1), whose model.fit works "
        "under MultiWorkerMirrored. None: Keras 3, and a train_fn that calls .fit() is refused (Keras 3's fit fails "
        "under MultiWorkerMirrored on TF 2.21). keras3: Keras 3, unchecked."))
    nonfinite_loss: Literal["stop", "continue"] = Field(default="stop", description=(
        "A NaN or infinite epoch loss: stop the job (exit 1, nothing exported), or continue regardless."))
    deterministic: bool = Field(default=False, description=(
        "A reproducible run: TensorFlow's op determinism, and Dropout's random state kept in checkpoints, so a run "
        "killed and resumed ends with the weights of one never interrupted (the same spec, checkpoint settings "
        "included; a train_fn's own random state is its to checkpoint). Turns output.timing off: TensorFlow refuses timestamps under op determinism. Not with parameter_server, "
        "failure.elastic, data.cache or dataset_fn."))

    @property
    def effective_batch_size(self) -> int:
        return self.global_batch_size * self.accumulation_steps

    def describe_batch(self) -> str:
        """The effective batch as messages name it: "512 x 4 accumulation steps", or "64"."""
        if self.accumulation_steps > 1:
            return f"{self.global_batch_size} x {self.accumulation_steps} accumulation steps"
        return str(self.global_batch_size)


class ClusterSpec(StrictModel):
    workers: int = Field(default=2, ge=1, description=(
        "Worker tasks (one Ray actor each); 1, and the default, under one_device and central_storage."))
    cpus_per_worker: float = Field(default=1.0, ge=0, description=(
        "CPUs each worker's bundle reserves; its TensorFlow pools get that many intra-op threads (one below 1 CPU, "
        "whose idle threads then do not spin)."))
    gpus_per_worker: float = Field(default=0.0, ge=0, description=(
        "GPUs each worker's bundle reserves (a fraction shares a GPU). Each GPU is a replica."))
    resources_per_worker: dict[str, float] = Field(default_factory=dict, description=(
        "Custom Ray resources each worker asks for too, e.g. {spot: 1} to run only on the node types that declare "
        "them (cluster.yaml's spot GPU nodes do)."))
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(default="pack", description=(
        "The placement group's strategy for the bundles."))
    gpu_placement: Literal["per_gpu", "per_node"] | None = Field(default=None, description=(
        "per_gpu: one worker per GPU (gpus_per_worker <= 1, fractions share a GPU); per_node: one worker per node "
        "using all gpus_per_worker GPUs of it (MirroredStrategy inside the node, collectives across nodes), placed "
        "strict_spread. None: as the other keys say."))
    gpu_memory_growth: bool = Field(default=True, description=(
        "Allocate GPU memory as needed, so fractional-GPU workers can share a GPU."))
    communication: Literal["auto", "ring", "nccl"] = Field(default="auto", description=(
        "MultiWorkerMirrored's collectives: auto (TensorFlow picks), ring (gRPC, any device) or nccl (GPUs only)."))
    collective_timeout_s: float | None = Field(default=None, gt=0, description=(
        "A collective not done in this long fails (a dead or frozen peer) instead of blocking; the hang watchdog "
        "(failure.hang_timeout_s) stays the backstop. None: TensorFlow's default, no timeout."))
    reserve_timeout_s: float = Field(default=60.0, gt=0, description=(
        "How long to wait for the cluster to give the placement group (exit 3 after)."))
    start_timeout_s: float = Field(default=120.0, gt=0, description=(
        "How long the actors may take to start and report in."))
    ps: int = Field(default=0, ge=0, description=(
        "strategy: parameter_server only: ps tasks, which hold the variables (at least 1)."))
    cpus_per_ps: float = Field(default=1.0, ge=0, description="parameter_server: CPUs each ps task reserves.")
    cpus_per_chief: float = Field(default=1.0, ge=0, description=(
        "parameter_server: CPUs the chief (the coordinator) reserves."))
    evaluator: bool = Field(default=False, description=(
        "parameter_server: a side-car task that evaluates each checkpoint on the validation data (needs "
        "checkpoint.dir and data.validation)."))
    variable_partitioner: "PartitionerSpec | None" = Field(default=None, description=(
        "parameter_server: how variables are split over the ps tasks. None: kind min_size with its defaults."))

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


class PartitionerSpec(StrictModel):
    """How variables are split over the ps tasks (TF's variable_partitioner). min_size: shards of at least
    min_shard_bytes, at most one per ps task (small variables stay whole); fixed: `shards` shards each."""

    kind: Literal["min_size", "fixed"] = Field(default="min_size", description=(
        "min_size: shards of at least min_shard_bytes, at most one per ps task; fixed: `shards` shards each."))
    min_shard_bytes: int = Field(default=256 << 10, ge=1, description=(
        "min_size: the smallest shard; smaller variables stay whole."))
    shards: int | None = Field(default=None, ge=1, description="fixed: the shards of each variable.")

    @model_validator(mode="after")
    def _shards_for_fixed(self) -> "PartitionerSpec":
        if self.kind == "fixed" and self.shards is None:
            raise ValueError("cluster.variable_partitioner: kind fixed needs shards (e.g. shards: 2)")
        if self.kind == "min_size" and self.shards is not None:
            raise ValueError("cluster.variable_partitioner: shards is for kind: fixed; min_size uses min_shard_bytes")
        return self


ClusterSpec.model_rebuild()


class ElasticSpec(StrictModel):
    min_workers: int = Field(ge=1, description="The fewest workers the job goes on with; at most cluster.workers.")
    grow_check_s: float = Field(default=60.0, ge=0, description=(
        "While the job runs below cluster.workers, how often to ask whether the missing workers fit again (a node "
        "came back, the autoscaler added one). When they do, every worker stops at one step and checkpoints "
        "there, and the job restarts at the full size from it (not counted against max_restarts). Needs checkpoint.dir. "
        "0: never."))


class FailureSpec(StrictModel):
    hang_timeout_s: float = Field(default=300.0, gt=0, description=(
        "With no progress from a rank for this long, the attempt is declared hung and torn down."))
    hang_mode: Literal["restart", "observe"] = Field(default="restart", description=(
        "What the watchdog does after hang_timeout_s without progress. Both write every rank's Python stacks to "
        "<output.dir>/hangs/attempt-<n>/ and say what each rank was doing; restart: then tear the attempt down (a "
        "restart under max_restarts); observe: only report (once per rank and attempt) and keep waiting."))
    max_restarts: int = Field(default=0, ge=0, description=(
        "Restarts after a worker or node dies, hangs or loses its network: from the latest checkpoint, or from the "
        "start when checkpoint.dir is not set."))
    elastic: ElasticSpec | None = Field(default=None, description=(
        "When the cluster cannot give back all workers after a failure, go on with fewer (>= min_workers), keeping "
        "the effective batch. None: only the full size."))
    standby: bool = Field(default=True, description=(
        "With max_restarts > 0 (mirrored, one_device, central_storage): from the first attempt's start (after a restart: once it trains "
        "again), keep one warm process per worker with TensorFlow imported, so a restart promotes them instead of starting new "
        "ones; none once the restarts are used up."))
    preemption: bool = Field(default=True, description=(
        "When Ray marks a node of the job as draining (a spot instance reclaimed, `ray drain-node`), every worker "
        "stops at one common step, the job checkpoints there and restarts without the node, free of "
        "failure.max_restarts. Needs checkpoint.dir; false: carry on until the node goes."))


class CheckpointSpec(StrictModel):
    dir: str | None = Field(default=None, description=(
        "A local directory (shared by all nodes) or a pyarrow.fs URI (s3://, gs://, hdfs://). None: no checkpoints "
        "(with resume: auto or true, <output.dir>/checkpoints)."))
    every_steps: int | None = Field(default=None, ge=1, description=(
        "Checkpoint every this many optimizer steps (instead of every_epochs)."))
    every_epochs: int | None = Field(default=None, ge=1, description=(
        "Checkpoint every this many epochs. None (and no every_steps): every epoch."))
    keep: int = Field(default=3, ge=1, description="Checkpoints kept; older ones are pruned.")
    background: bool = Field(default=True, description=(
        "Upload each checkpoint in the background: training goes on once the state is written to the node's "
        "disk, and the chief uploads it to dir (raytf.json last: visible only once complete) while the next "
        "steps run; one upload in flight, the next checkpoint waits for it. A drain's checkpoint and the last "
        "one are complete before the task ends. false: every rank waits for the upload."))
    _uri = field_validator("dir")(classmethod(lambda cls, v: _storage_uri(v)))

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


class ProfileSpec(StrictModel):
    """A tf.profiler trace of optimizer steps first..last (1-based, inclusive) on the given ranks."""

    steps: tuple[int, int] = Field(description="[first, last] optimizer steps to trace, 1-based, inclusive.")
    ranks: list[int] = Field(default_factory=lambda: [0], min_length=1, description=(
        "The ranks to trace (under parameter_server only rank 0, the chief)."))

    @model_validator(mode="after")
    def _order(self) -> "ProfileSpec":
        first, last = self.steps
        if not 1 <= first <= last:
            raise ValueError(f"steps [{first}, {last}]: give [first, last] optimizer steps, 1 <= first <= last, "
                             f"e.g. steps: [10, 20]")
        if any(r < 0 for r in self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ranks {self.ranks}: distinct ranks >= 0, e.g. ranks: [0]")
        return self


class OutputSpec(StrictModel):
    dir: str | None = Field(default=None, min_length=1, description=(
        "Where result.json, the model, the SavedModel and TensorBoard events go: a local folder or a URI pyarrow.fs "
        "opens (s3://bucket/path, gs://, hdfs://). None: runs/<name> in the job folder."))
    _uri = field_validator("dir")(classmethod(lambda cls, v: _storage_uri(v)))
    tensorboard: bool = Field(default=True, description="Write TensorBoard events (epoch scalars, timing).")
    export: list[Literal["keras", "saved_model"]] = Field(default_factory=lambda: ["keras"], min_length=1, description=(
        "keras: model.keras; saved_model: a TensorFlow SavedModel for TF Serving, at saved_model/."))
    profile: ProfileSpec | None = Field(default=None, description=(
        "A tf.profiler trace, into tensorboard/ for TensorBoard's profile plugin. None: no trace."))
    timing: bool = Field(default=True, description=(
        "Each worker's input wait and step time, measured in its steps; stragglers named. Its cost is below what a "
        "run-to-run comparison resolves (benchmarks/bench_metrics.py --key output.timing)."))
    metrics: bool = Field(default=True, description=(
        "Prometheus series per task (steps, examples, input wait, step time, loss, phase, checkpoint time) and per "
        "job (state, restarts) through Ray's metrics API, exported by every Ray node's metrics endpoint "
        "(ray_raytf_*). Its cost: benchmarks/bench_metrics.py."))


class MlflowSpec(StrictModel):
    uri: str = Field(min_length=1, description=(
        "MLflow's tracking URI: a server (http://host:5000) or a database (sqlite:///mlflow.db: relative to the job "
        "folder). Credentials come from MLflow's own environment variables (MLFLOW_TRACKING_TOKEN, "
        "MLFLOW_TRACKING_USERNAME/PASSWORD), never from the spec."))
    experiment: str | None = Field(default=None, min_length=1, description=(
        "The MLflow experiment the run goes into (made if missing). None: the job's name."))

    @field_validator("uri")
    @classmethod
    def _no_password(cls, value: str) -> str:
        if re.match(r"^[a-z][a-z0-9+.-]*://[^/@]*:[^/@]*@", value, re.IGNORECASE):
            raise ValueError("the URI carries a password, which result.json and every log would repeat; give the "
                             "server without it and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                             "MLFLOW_TRACKING_TOKEN) in the environment")
        return value


class TrackingSpec(StrictModel):
    mlflow: MlflowSpec | None = Field(default=None, description=(
        "Log the run to MLflow from the driver: the spec as params, each epoch's metrics, the exported model as "
        "artifacts, the end as the run's status; a sweep is a parent run with a nested run per trial. Needs "
        "`pip install 'raytf[mlflow]'`. None: no tracking."))


class JobSpec(StrictModel):
    name: str = Field(pattern=r"^[\w.-]+$", max_length=100, description=(
        "The job's name: actors, output folder (runs/<name>) and messages carry it."))
    base_dir: str | None = Field(default=None, description=(
        "The job folder: relative paths and module:function names resolve against it, and it travels to every actor. "
        "None: the job file's folder; a relative base_dir is relative to that folder."))
    strategy: Literal["mirrored", "parameter_server", "one_device", "central_storage"] = Field(
        default="mirrored", description=(
            "mirrored: MultiWorkerMirroredStrategy, every worker a replica (one machine's GPUs included); "
            "parameter_server: ParameterServerStrategy, variables on ps tasks; one_device: OneDeviceStrategy, one "
            "task on one device (debugging); central_storage: CentralStorageStrategy, one task whose GPUs compute "
            "and whose CPU holds the variables. TPUs: not run by raytf."))
    model: str | None = Field(default=None, pattern=FUNCTION_REF, description=(
        "A module:function returning an uncompiled keras.Model. Required unless train_fn is given."))
    data: DataSpec | None = Field(default=None, description=(
        "Parquet input, sharded over the workers; give this or dataset_fn."))
    dataset_fn: str | None = Field(default=None, pattern=FUNCTION_REF, description=(
        "A module:function returning a tf.data.Dataset batched per replica (it gets a tf.distribute.InputContext); "
        "instead of data. Needs train.steps_per_epoch."))
    train_fn: str | None = Field(default=None, pattern=FUNCTION_REF, description=(
        "A module:function taking ctx: your own training loop instead of raytf's, on every worker (the chief under "
        "parameter_server)."))
    config: dict[str, Any] = Field(default_factory=dict, description=(
        "Free-form settings for the job's own code (a train_fn's hyperparameters, as Ray Train's train_loop_config): "
        "ctx.config in the train_fn; a sweep's space may set config.<key> like any key."))
    loss: Union[str, LossSpec] = Field(default="sparse_categorical_crossentropy", validate_default=True, description=(
        "A Keras loss name, or {name, from_logits}."))
    optimizer: OptimizerSpec = Field(default=OptimizerSpec(), description=(
        "The optimizer, its learning rate, schedule and large-batch scaling."))
    metrics: list[str] = Field(default_factory=list, description=(
        "Keras metric names, computed exactly over all replicas each epoch."))
    train: TrainSpec = Field(default=TrainSpec(), description="How long and in what batches to train.")
    cluster: ClusterSpec = Field(default=ClusterSpec(), description="The tasks and the resources each reserves.")
    failure: FailureSpec = Field(default=FailureSpec(), description=(
        "Hangs, restarts, elastic sizes, standbys and preemption."))
    checkpoint: CheckpointSpec = Field(default=CheckpointSpec(), description="Where and how often to checkpoint.")
    output: OutputSpec = Field(default=OutputSpec(), description="What the run writes and where.")
    tracking: TrackingSpec = Field(default=TrackingSpec(), description=(
        "Experiment tracking the driver does for you (MLflow); no tracking code in your script."))
    resume: Union[bool, Literal["auto"]] = Field(default=False, description=(
        "false: a fresh run (a checkpoint.dir holding checkpoints is an error); true: continue from its latest "
        "checkpoint (as --resume); auto: continue if there is one, start if not, and train nothing if this run "
        "already succeeded in output.dir. Resuming, checkpoints default to <output.dir>/checkpoints. --resume [auto] "
        "overrides it."))

    @model_validator(mode="before")
    @classmethod
    def _one_task_by_default(cls, data: Any) -> Any:
        """one_device and central_storage are one task's strategies: cluster.workers defaults to 1 there."""
        if isinstance(data, Mapping) and data.get("strategy") in ONE_TASK_STRATEGIES:
            cluster = data.get("cluster") or {}
            if isinstance(cluster, Mapping) and "workers" not in cluster:
                data = {**data, "cluster": {**cluster, "workers": 1}}
        return data

    @field_validator("strategy", mode="before")
    @classmethod
    def _no_tpu(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in ("tpu", "tpustrategy", "tpu_strategy"):
            raise ValueError(f"{value}: raytf does not run TPUs (its tasks are Ray actors on GPU and CPU nodes, and "
                             f"TPUStrategy needs a TPU cluster resolver raytf does not set up); for TPUs use Ray's "
                             f"TPU support on GKE with JAX, or TPUStrategy outside raytf; here, one of mirrored, "
                             f"parameter_server, one_device, central_storage")
        return value

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_value(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f"{value!r} is not one of false, true, auto; e.g. resume: auto")

    @field_validator("loss")
    @classmethod
    def _loss_as_spec(cls, value: Union[str, LossSpec]) -> LossSpec:
        return LossSpec(name=value) if isinstance(value, str) else value


# The strategies that run one task (cluster.workers defaults to 1 for them).
ONE_TASK_STRATEGIES = ("one_device", "central_storage")

# The keys that name a `module:function` of the job's code.
FUNCTION_KEYS = ("model", "dataset_fn", "train_fn", "data.preprocess", "data.preprocess_validation")


def function_ref(spec: JobSpec, key: str) -> str | None:
    """The module:function a FUNCTION_KEYS key names in `spec` (None: not set)."""
    section, _, name = key.rpartition(".")
    holder = getattr(spec, section) if section else spec
    return getattr(holder, name) if holder is not None else None
