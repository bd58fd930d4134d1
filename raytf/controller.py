"""One job from placement to result: PLACE -> START -> RENDEZVOUS -> RUN -> DONE.

The controller owns every actor and the placement group it creates, and frees them on every path out
(success, failure, Ctrl-C). The group class is a parameter, so tests can put a seam there.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import ray

from raytf import placement, rendezvous
from raytf.errors import PortTaken, TrainingFailed
from raytf.group import WorkerGroup, describe, root_cause
from raytf.report import ProgressDisplay, Result, summary_table, write_artifacts
from raytf.spec import Job, code_root
from raytf.worker_api import WorkerPayload

RENDEZVOUS_ATTEMPTS = 3  # fresh ports each time; a port lost twice in a row is already rare
POLL_INTERVAL_S = 1.0
PEER_ERROR_GRACE_S = 5.0  # after a rank fails, how long to collect the others' errors before teardown


def build_payload(job: Job) -> WorkerPayload:
    spec = job.spec
    if spec.data is None:
        return WorkerPayload(spec=spec)
    val = spec.data.validation
    return WorkerPayload(
        spec=spec,
        train_data=job.datasets["train"], train_root=job.actor_data_path(spec.data.train),
        val_data=job.datasets.get("validation"), val_root=job.actor_data_path(val) if val else None,
    )


def runtime_env(job: Job) -> dict[str, Any]:
    """The job folder travels to every actor as its working directory; modules found only in the
    driver's working directory travel as py_modules. Outputs stay behind."""
    spec = job.spec
    extra_modules = []
    for ref in (spec.model, spec.dataset_fn, spec.train_fn):
        if ref is None:
            continue
        top = ref.partition(":")[0].split(".")[0]
        root = code_root(top, job.job_dir)
        if root is not None and root != job.job_dir:
            path = root / top if (root / top).is_dir() else root / f"{top}.py"
            extra_modules.append(str(path))
    excludes = [".git", "__pycache__"]
    try:
        excludes.append("/" + str(job.output_dir.relative_to(job.job_dir)))
    except ValueError:
        pass
    env = {"working_dir": str(job.job_dir), "excludes": excludes,
           "env_vars": {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}}
    if extra_modules:
        env["py_modules"] = sorted(set(extra_modules))
    return env


def upload_code(env: dict[str, Any]) -> dict[str, Any]:
    """Upload local working_dir/py_modules to the cluster and put their URIs in their place.

    Ray accepts local paths only in ray.init's job-level runtime_env; raytf sets the env per actor
    (it may run in a process whose Ray someone else initialised: a notebook, a Tune trial), so it
    uploads the way ray.init does. These helpers are Ray-private; raytf pins Ray 2.60.*."""
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    env = upload_py_modules_if_needed(dict(env), include_gitignore=include_gitignore)
    return upload_working_dir_if_needed(env, include_gitignore=include_gitignore)


def run(job: Job, group_cls: Callable[..., WorkerGroup] = WorkerGroup,
        display: ProgressDisplay | None = None) -> Result:
    spec = job.spec
    display = display or ProgressDisplay(quiet=True)
    started = time.time()
    result = Result(name=spec.name, strategy=spec.strategy, status="failed", output_dir=str(job.output_dir))
    payload = build_payload(job)
    bundles = placement.worker_bundles(spec.cluster)
    env = upload_code(runtime_env(job))
    display.message(f"raytf: reserving {len(bundles)} x {bundles[0]} ({spec.cluster.placement})")
    pg = placement.reserve(bundles, spec.cluster.placement, spec.cluster.reserve_timeout_s,
                           name=f"raytf-{spec.name}-{os.getpid()}")
    phase = _PhaseClock(result.phases, started)
    phase.done("reserve_s")
    try:
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            group = group_cls(pg, bundles, env)
            try:
                tasks = _start(group, payload, spec.cluster.start_timeout_s)
            except PortTaken as exc:
                group.stop()
                if attempt == RENDEZVOUS_ATTEMPTS:
                    raise
                display.message(f"raytf: {exc}; new rendezvous (attempt {attempt + 1})")
                continue
            except BaseException:
                group.stop()
                raise
            result.rendezvous_attempts = attempt
            break
        phase.done("start_s")
        display.message("raytf: " + ", ".join(f"rank {t.rank}@{t.address}" + (f" gpu {','.join(t.gpu_ids)}" if t.gpu_ids else "")
                                               for t in tasks))
        try:
            outcomes = _supervise(group, payload, display, spec.failure.hang_timeout_s)
            phase.done("train_s")
        finally:
            group.stop()
    except BaseException as exc:
        result.error = str(exc)
        result.wall_s = round(time.time() - started, 3)
        result.write()
        raise
    finally:
        placement.release(pg)

    chief = outcomes[0]
    write_artifacts(job.output_dir, chief.pop("artifacts", {}))
    result.status = "succeeded"
    result.history = chief["history"]
    result.tasks = [dict(rank=t.rank, role="chief" if t.rank == 0 else "worker", node_ip=t.node_ip,
                         node_id=t.node_id, address=t.address, gpu_ids=list(t.gpu_ids),
                         cuda_visible_devices=t.cuda_visible_devices,
                         weights_digest=o.get("weights_digest"), steps=o.get("steps"))
                    for t, o in zip(tasks, outcomes)]
    result.wall_s = round(time.time() - started, 3)
    if chief.get("first_step_at"):
        result.time_to_first_step_s = round(chief["first_step_at"] - started, 3)
        train_s = chief["finished_at"] - chief["first_step_at"]
        steps_after_first = max(chief["steps"] - 1, 0)
        if train_s > 0 and steps_after_first:
            result.examples_per_s = round(steps_after_first * spec.train.global_batch_size / train_s, 1)
    model_path = job.output_dir / "model.keras"
    result.model_path = str(model_path) if model_path.exists() else None
    tb = job.output_dir / "tensorboard"
    result.tensorboard_dir = str(tb) if tb.exists() else None
    phase.done("finish_s")
    result.write()
    display.message(summary_table(result.history))
    return result


def _start(group: WorkerGroup, payload: WorkerPayload, timeout_s: float) -> list[rendezvous.Task]:
    reports = group.start(timeout_s)
    tasks = rendezvous.assign_ranks(reports)
    group.setup(tasks, payload, timeout_s)
    return tasks


def _supervise(group: WorkerGroup, payload: WorkerPayload, display: ProgressDisplay,
               hang_timeout_s: float) -> list[dict[str, Any]]:
    """Wait for every rank while showing progress; the first failure or a hang ends the attempt."""
    refs = group.train(payload)
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    outcomes: dict[int, dict[str, Any]] = {}
    pending = list(refs)
    now = time.time()
    last_seen = {rank: (None, now) for rank in range(len(refs))}
    rate = _Rate()
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=POLL_INTERVAL_S)
        for ref in done:
            try:
                outcomes[rank_of[ref]] = ray.get(ref)
            except Exception as exc:
                _fail(rank_of, ref, exc, pending)
        if not pending:
            break
        progress = group.progress(timeout_s=POLL_INTERVAL_S * 4)
        now = time.time()
        for rank, p in enumerate(progress):
            if p is None:
                continue
            marker = (p.get("phase"), p.get("global_step"))
            if marker != last_seen[rank][0]:
                last_seen[rank] = (marker, now)
        stalled = [rank for rank, (_, seen) in last_seen.items() if rank not in outcomes and now - seen > hang_timeout_s]
        if stalled:
            raise TrainingFailed(f"training hung: rank(s) {stalled} made no progress for {hang_timeout_s:g}s "
                                 f"(failure.hang_timeout_s)", {"hung": stalled})
        display.update(progress[0], rate.update(progress[0]))
    return [outcomes[rank] for rank in range(len(refs))]


def _fail(rank_of: dict, failed_ref, exc: BaseException, pending: list) -> None:
    """Aggregate: the first failure is the root cause; peers' errors (often a broken collective as a
    consequence) are grouped by message and listed after it."""
    causes: dict[str, list[int]] = {describe(exc): [rank_of[failed_ref]]}
    if pending:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_ERROR_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as peer_exc:
                causes.setdefault(describe(peer_exc), []).append(rank_of[ref])
    lines = [f"rank(s) {', '.join(map(str, ranks))}: {msg}" for msg, ranks in causes.items()]
    message = "training failed: " + lines[0]
    if len(lines) > 1:
        message += "; then " + "; ".join(lines[1:])
    raise TrainingFailed(message, causes) from root_cause(exc)


class _PhaseClock:
    """Seconds spent in each phase of the run, for result.json's `phases`."""

    def __init__(self, phases: dict[str, float], started: float):
        self.phases, self._last = phases, started

    def done(self, name: str) -> None:
        now = time.time()
        self.phases[name] = round(now - self._last, 3)
        self._last = now


class _Rate:
    """examples/s from the chief's running example count."""

    def __init__(self):
        self._prev: tuple[float, int] | None = None
        self.value: float | None = None

    def update(self, p: dict[str, Any] | None) -> float | None:
        if not p or "examples_seen" not in p:
            return self.value
        point = (p["updated"], p["examples_seen"])
        if self._prev and point[0] > self._prev[0] and point[1] > self._prev[1]:
            self.value = (point[1] - self._prev[1]) / (point[0] - self._prev[0])
        if not self._prev or point[1] != self._prev[1]:
            self._prev = point
        return self.value

