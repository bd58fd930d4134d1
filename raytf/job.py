"""A job: its spec read from YAML (with `--set` overrides), validated, and resolved against its folder.

`parse` validates a mapping (pure); `load` also finds the job's folder, modules, checkpoint folder and data,
then imports and checks the job's code (`raytf.job_code`). Everything a user can get wrong is found here,
once, before any actor starts: the checks that need no TensorFlow first.
"""
from __future__ import annotations

import copy
import importlib.util
import dataclasses
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ValidationError

from raytf import backends, learning_rate, spec_rules, yaml_file
from raytf.errors import SpecError, clip
from raytf.job_code import check_job_code, check_train_fn_keras, find_module
from raytf.labels import check_labels
from raytf.spec import FUNCTION_KEYS, JobSpec, function_ref
from raytf.storage import TIMEOUT_S, endpoint_of, is_uri, shown, within


@dataclasses.dataclass(frozen=True)
class Job:
    """A validated spec plus where it came from: the folder its relative paths and modules resolve against."""

    spec: JobSpec
    job_dir: Path
    source: str | None = None  # the YAML path, for messages
    datasets: dict = dataclasses.field(default_factory=dict)  # split -> data.DatasetInfo, read once by load
    staging: Path | None = None  # for output.dir in storage: the local folder raytf.driver.output.claim made

    @property
    def checkpoint_dir(self) -> str | None:
        """checkpoint.dir as every process must see it: URIs as they are, relative paths under the job folder.
        Unset, a run that resumes (resume: auto or true, --resume) keeps them in its storage:
        <output.dir>/checkpoints."""
        location = self.spec.checkpoint.dir
        if location is None:
            return f"{self.output_where}/checkpoints" if self.spec.resume else None
        return self.data_path(location)

    @property
    def output_where(self) -> str:
        """output.dir as the user means it: a URI as given, a local path resolved against the job folder."""
        out = self.spec.output.dir or f"runs/{self.spec.name}"
        return out.rstrip("/") if is_uri(out) else str(_resolve(self.job_dir, out))

    @property
    def output_dir(self) -> Path:
        """The local folder this process writes the run's results into: output.dir itself, or for a URI a
        staging folder on this machine that raytf.driver.output ships up to it."""
        where = self.output_where
        if not is_uri(where):
            return Path(where)
        if self.staging is None:
            raise RuntimeError(f"output.dir {where}: results are written only into the staging folder "
                               f"raytf.driver.output.claim makes for the run")
        return self.staging

    def output_location(self, rel: str) -> str:
        """Where a result file ends up (a URI for output.dir on object storage)."""
        return f"{self.output_where}/{rel}"

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





def parse(raw: Mapping[str, Any], source: str = "job spec") -> JobSpec:
    """Validate a plain mapping into a JobSpec: its fields, then the rules across them. Pure: imports no user code."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"{source}: expected a mapping of sections (name, model, data, ...), got {type(raw).__name__}")
    try:
        spec = JobSpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise SpecError(_describe_validation_error(exc, source)) from None
    try:
        spec_rules.check(spec)
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    return spec


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


def _dumped(spec: JobSpec, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A parsed spec as a mapping again, to override. It carries every key, defaults included: a worker
    count that is only the old strategy's default (2, or 1 for one task's) goes when the strategy changes,
    so the new strategy's default applies (a sweep over strategy, pbt's choices)."""
    raw = spec.model_dump()
    before, after = backends.BACKENDS[spec.strategy], backends.BACKENDS.get(overrides.get("strategy", spec.strategy))
    if after not in (None, before) and "cluster.workers" not in overrides and "cluster" not in overrides:
        if spec.cluster.workers == before.default_workers:
            raw["cluster"].pop("workers", None)
    return raw


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
    raw = yaml_file.read(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping of sections (name, model, data, ...)")
    return raw





def load(source: "str | Path | Mapping[str, Any] | JobSpec | Job",
         overrides: Mapping[str, Any] | None = None,
         check_data: bool = True, check_code: bool = True, check_storage: bool = True) -> Job:
    """Load, override, validate and resolve a job: the one place a spec is checked.

    The checks that need no TensorFlow come first (shape, paths, modules found, checkpoint dir, data,
    divisibility), so a spec wrong in those ways fails in a fraction of an `import tensorflow`; only then
    are the named functions imported and the Keras names checked (`check_code`: `check_job_code`).
    `check_storage=False` skips the write probes of output.dir and checkpoint.dir, for a caller that has just
    loaded the same job with them."""
    overrides = dict(overrides or {})
    if isinstance(source, Job):
        if not overrides:
            return source
        raw, start, name = _dumped(source.spec, overrides), None, source.source
    elif isinstance(source, JobSpec):
        raw, start, name = _dumped(source, overrides), Path.cwd(), "job spec"
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
    if spec.tracking.mlflow is not None and importlib.util.find_spec("mlflow") is None:
        raise SpecError("tracking.mlflow: MLflow's client is not installed in this environment; pip install "
                        "'raytf[mlflow]' (on a cluster: in its image), or remove tracking from the spec")
    # Bad storage is found before the job's code is imported, not after it trained. pyarrow is imported only
    # for a job that needs it: `import raytf` and a spec error stay fast.
    if check_storage and is_uri(job.output_where):
        from raytf.storage import Folder

        Folder(job.output_where, "output.dir").check_writable()
    if check_storage and job.checkpoint_dir is not None:
        from raytf.checkpoint import Storage

        Storage(job.checkpoint_dir).check_writable()
    return complete(job, check_data=check_data, check_code=check_code)


def complete(job: Job, check_data: bool = True, check_code: bool = True) -> Job:
    """The checks `load` makes after a job's shape, on a job loaded with check_data/check_code off: its data
    read (Parquet footers, labels, batches) and its code imported. The job file is not read again."""
    spec, name = job.spec, job.source
    if check_data and spec.data is not None:
        from raytf import data_scan  # pyarrow only; no TensorFlow

        for split in ("train", "validation"):
            path = getattr(spec.data, split)
            if path is not None:
                where = job.data_path(path)
                read = lambda where=where, split=split: data_scan.read_info(  # noqa: E731
                    where, spec.data.features, spec.data.label, key=f"data.{split}", fill_nulls=spec.data.fill_nulls)
                # a bucket that never answers is an error naming it, not a hang (raytf.storage's deadline)
                job.datasets[split] = within(TIMEOUT_S, f"data.{split} {shown(where)} ({endpoint_of(where)})",
                                             read) if is_uri(where) else read()
                data_scan.check_images(job.datasets[split], spec.data.decode, key=f"data.{split}")
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
            try:  # the schedule against the steps the rows make (data.remainder: pad may add one)
                learning_rate.in_steps(spec, rows // batch)
            except ValueError as exc:
                raise SpecError(f"{name}: {exc}") from None
    if check_code:
        check_job_code(job.spec, job.job_dir, job.datasets)
    return job


def read_job(job_file: "str | Path", settings: "list[str] | tuple[str, ...]" = ()) -> Job:
    """A job file read, with `--set KEY=VALUE` settings, and validated into a Job: its shape only (pure: no
    code imported, no data read, no storage touched), for commands that describe a job rather than run it
    (submit, k8s, results). SpecError as `load`'s."""
    path = Path(job_file).expanduser().resolve()
    spec = parse(apply_overrides(read_yaml(path), parse_set_options(list(settings))), str(job_file))
    return Job(spec=spec, job_dir=job_folder(spec, path.parent, str(job_file)), source=str(job_file))


def job_folder(spec: JobSpec, start: Path, source: str = "job spec") -> Path:
    """The job folder: base_dir resolved against `start` (the job file's folder), else `start`."""
    if spec.base_dir is None:
        return start
    folder = _resolve(start, spec.base_dir)
    if not folder.is_dir():
        raise SpecError(f"{source}: base_dir {spec.base_dir!r} ({folder}) is not a folder; point it at the folder "
                        f"that holds the job's code and data, or remove it")
    return folder
