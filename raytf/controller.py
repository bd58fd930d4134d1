"""One job from placement to result: PLACE -> START -> RENDEZVOUS -> RUN -> DONE.

The controller owns every actor and the placement group it creates, and frees them on every path out
(success, failure, Ctrl-C). The group class is a parameter, so tests can put a seam there.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError

from raytf import failure as failure_lib
from raytf import placement, rendezvous
from raytf.checkpoint import Storage
from raytf.errors import PlacementTimeout, PortTaken, SpecError, TrainingFailed, WorkerStartupError
from raytf.failure import Failure
from raytf.group import WorkerGroup, describe, root_cause
from raytf.packaging import runtime_env, upload_code
from raytf.report import ProgressDisplay, Result, summary_table, write_artifacts
from raytf.spec import Job, JobSpec
from raytf.worker_api import WorkerPayload

RENDEZVOUS_ATTEMPTS = 3  # fresh ports each time; a port lost twice in a row is already rare
POLL_INTERVAL_S = 1.0
PEER_ERROR_GRACE_S = 2.0  # after a rank fails, how long to collect the others' errors before teardown


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


class AttemptFailed(Exception):
    """One attempt ended badly; `failure` says how, for the restart policy."""

    def __init__(self, failure: Failure, nodes: list[str] | None = None):
        super().__init__(failure.message)
        self.failure, self.nodes = failure, nodes or []


class EpochFeed:
    """Hands each finished epoch's metrics, once and in order, to the display and to `on_epoch`
    (Ray Tune's report, for instance), across restarts."""

    def __init__(self, display: ProgressDisplay, on_epoch: Callable[[dict[str, Any]], None] | None):
        self.display, self.on_epoch, self.last = display, on_epoch, 0

    def feed(self, epochs: list[dict[str, Any]]) -> None:
        for metrics in epochs:
            if metrics.get("epoch", 0) > self.last:
                self.last = metrics["epoch"]
                self.display.epoch(metrics)
                if self.on_epoch is not None:
                    self.on_epoch(dict(metrics))


def run(job: Job, group_cls: Callable[..., WorkerGroup] = WorkerGroup,
        display: ProgressDisplay | None = None, resume: bool = False,
        on_epoch: Callable[[dict[str, Any]], None] | None = None, placement_group=None,
        code_env: dict[str, Any] | None = None, verbose: bool = False) -> Result:
    """Attempts until one succeeds or the failure policy gives up: each attempt reserves, starts,
    trains and tears down; a restart resumes from the latest checkpoint.

    `on_epoch(metrics)` is called once per finished epoch. `placement_group`: run in a group someone
    else reserved (a Ray Tune trial's), one bundle per worker from index 0; it is not removed here.
    `code_env`: the actors' runtime env, already uploaded by `packaging.upload_code` (a sweep uploads the job
    folder once, from the driver, for all its trials: a trial may run on a node without that folder).
    `verbose`: Ray's own lines about the upload too."""
    spec = job.spec
    display = display or ProgressDisplay(quiet=True)
    epochs = EpochFeed(display, on_epoch)
    started = time.time()
    result = Result(name=spec.name, strategy=spec.strategy, status="failed", output_dir=str(job.output_dir))
    storage = _checkpoint_storage(job, resume)
    env = code_env if code_env is not None else upload_code(runtime_env(job), verbose=verbose)
    bad_checkpoints: set[str] = set()
    held = _HeldGroup(placement_group)
    standby = _StandbyPool(spec.failure.standby and spec.failure.max_restarts > 0 and spec.strategy == "mirrored")
    base_payload = dataclasses.replace(build_payload(job), checkpoint_dir=job.checkpoint_dir)
    try:
        while True:
            # Every attempt asks for the full worker count; _attempt shrinks it under failure.elastic.
            resume_from = storage.latest(exclude=bad_checkpoints) if storage and (resume or result.restarts) else None
            payload = dataclasses.replace(base_payload, resume_from=resume_from)
            try:
                tasks, outcomes = _attempt(job, spec, payload, group_cls, env, display, result,
                                           elastic=bool(result.restarts), epochs=epochs, held=held, standby=standby)
                break
            except AttemptFailed as failed:
                decision = failure_lib.decide(failed.failure, _counted(result.restarts), spec.failure.max_restarts)
                if not decision.restart:
                    raise TrainingFailed(f"training failed: {failed.failure.message}"
                                         + (f" ({decision.reason})" if result.restarts else ""),
                                         failed.failure.causes) from None
                if failed.failure.kind == "checkpoint":
                    bad_checkpoints.add(resume_from.path)
                result.restarts.append({
                    "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "time": round(time.time(), 3),
                    "kind": failed.failure.kind,
                    "reason": failed.failure.message, "ranks": list(failed.failure.ranks), "nodes": failed.nodes,
                    "resumed_from_step": None})
                display.message(f"raytf: attempt failed: {failed.failure.message}; {decision.reason}")
    except BaseException as exc:
        result.error = str(exc)
        result.wall_s = round(time.time() - started, 3)
        result.write()
        raise
    finally:
        standby.release()
        held.release()

    chief = outcomes[0]
    if result.restarts:  # when training was back on its feet after the last failure
        result.restarts[-1]["first_step_at"] = chief.get("first_step_at")
    epochs.feed(chief["history"])  # the epochs that ended after the last poll
    write_artifacts(job.output_dir, chief.pop("artifacts", {}))
    result.status = "succeeded"
    result.history = chief["history"]
    result.variable_devices = chief.get("variable_devices", {})
    recovered = chief.get("recovered_workers", [])
    for loss in result.worker_losses:  # the coordinator took the replacement back
        loss["rejoined"] = any(d.endswith(f"/job:worker/replica:0/task:{loss['worker']}") for d in recovered)
    evaluator = [o for t, o in zip(tasks, outcomes) if t.role == "evaluator"]
    if evaluator:
        result.evaluations = evaluator[0].get("evaluations", [])
        _merge_evaluations(result.history, result.evaluations)
    result.tasks = [dict(rank=t.rank, role=_role_name(t, spec), index=t.index, node_ip=t.node_ip,
                         node_id=t.node_id, address=t.address, gpu_ids=list(t.gpu_ids),
                         cuda_visible_devices=t.cuda_visible_devices,
                         weights_digest=o.get("weights_digest"), steps=o.get("steps"),
                         optimizer_steps=o.get("optimizer_steps"))
                    for t, o in zip(tasks, outcomes)]
    result.wall_s = round(time.time() - started, 3)
    if chief.get("first_step_at"):
        result.time_to_first_step_s = round(chief["first_step_at"] - started, 3)
        train_s = chief["finished_at"] - chief["first_step_at"]
        steps_after_first = max(chief["steps_run"] - 1, 0)
        if train_s > 0 and steps_after_first:
            result.examples_per_s = round(steps_after_first * spec.train.global_batch_size / train_s, 1)
    model_path = job.output_dir / "model.keras"
    result.model_path = str(model_path) if model_path.exists() else None
    tb = job.output_dir / "tensorboard"
    result.tensorboard_dir = str(tb) if tb.exists() else None
    result.write()
    display.message(summary_table(result.history))
    return result


def _role_name(task: rendezvous.Task, spec: JobSpec) -> str:
    if spec.strategy == "mirrored":
        return "chief" if task.rank == 0 else "worker"
    return task.role


def _merge_evaluations(history: list[dict[str, Any]], evaluations: list[dict[str, Any]]) -> None:
    """The evaluator's val_* metrics into the epochs whose end-of-epoch checkpoint it evaluated."""
    by_epoch = {e["epoch"]: e for e in evaluations if "epoch" in e}
    for metrics in history:
        found = by_epoch.get(metrics.get("epoch"))
        if found:
            metrics.update({k: v for k, v in found.items() if k.startswith("val_")})


def _counted(restarts: list[dict]) -> int:
    """Restarts charged to failure.max_restarts: a fallback from a corrupt checkpoint is not."""
    return sum(1 for r in restarts if r["kind"] != "checkpoint")


def _checkpoint_storage(job: Job, resume: bool) -> Storage | None:
    if job.checkpoint_dir is None:
        if resume:
            raise SpecError("--resume: the job has no checkpoint.dir to resume from; set checkpoint.dir")
        return None
    storage = Storage(job.checkpoint_dir)
    latest = storage.latest()
    if latest is not None and not resume:
        raise SpecError(f"checkpoint.dir {job.checkpoint_dir} already holds checkpoints (latest at step "
                        f"{latest.step}); pass --resume to continue from it, or choose another checkpoint.dir")
    return storage


def _with_workers(spec: JobSpec, workers: int) -> JobSpec:
    if workers == spec.cluster.workers:
        return spec
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"workers": workers})})


def _reserve(spec: JobSpec, display: ProgressDisplay, elastic: bool):
    """The placement group for this attempt. After a failure, with failure.elastic, a cluster that cannot
    give back every worker in time is asked for fewer (down to min_workers, keeping the batch divisible)."""
    sizes = [spec.cluster.workers]
    if elastic and spec.failure.elastic is not None:
        sizes = failure_lib.elastic_sizes(spec.cluster.workers, spec.failure.elastic.min_workers,
                                          spec.train.global_batch_size, spec.cluster.replicas_per_worker)
    for i, workers in enumerate(sizes):
        bundles = placement.job_bundles(_with_workers(spec, workers))
        timeout = spec.cluster.reserve_timeout_s if i == 0 else min(10.0, spec.cluster.reserve_timeout_s)
        roles = placement.bundle_roles(spec)
        shown = ", ".join(f"{roles.count(r)} {r}" for r in dict.fromkeys(roles)) if spec.strategy != "mirrored" else ""
        display.message(f"raytf: reserving {len(bundles)} x {bundles[-1]} " + (f"({shown}) " if shown else "")
                        + f"({spec.cluster.effective_placement})")
        try:
            return placement.reserve(bundles, spec.cluster.effective_placement, timeout,
                                     name=f"raytf-{spec.name}-{os.getpid()}"), bundles
        except PlacementTimeout:
            if i == len(sizes) - 1:
                raise
            display.message(f"raytf: {workers} workers not available; trying {sizes[i + 1]} (failure.elastic)")
    raise AssertionError("unreachable")


class _StandbyPool:
    """Warm actors for the next attempt, one per bundle (started once an attempt's actors are set up, or
    once a restarted attempt trains again): each has imported TensorFlow and holds no resources. Most of a restart
    is new processes importing TensorFlow; a restart promotes these instead (TF 2.21 cannot re-form a
    collective group inside a process that was in one, so survivors cannot be reused)."""

    STANDBY_CHECK_S = 1.0

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.pg = None
        self.actors: dict[int, tuple[Any, tuple, str | None]] = {}

    def fill(self, pg, bundles: list[dict[str, float]], env: dict[str, Any], tasks: list[rendezvous.Task]) -> None:
        if not self.enabled or self.actors:
            return
        from raytf.group import create_actor

        self.pg = pg
        for t in tasks:
            self.actors[t.bundle_index] = (create_actor(pg, t.bundle_index, {}, env), t.gpu_ids, t.cuda_visible_devices)

    def take(self, pg, count: int) -> dict[int, tuple[Any, tuple, str | None]]:
        """The live standbys of bundles 0..count-1 of this placement group; the others are let go."""
        if not self.actors:
            return {}
        actors, self.actors = self.actors, {}
        usable = {i: a for i, a in actors.items() if i < count and self.pg is not None and pg.id == self.pg.id}
        refs = {i: a[0].report.remote() for i, a in usable.items()}
        ready = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.STANDBY_CHECK_S)[0] if refs else []
        alive = {}
        for i, ref in refs.items():
            if ref in ready:
                try:
                    ray.get(ref)
                    alive[i] = usable[i]
                except Exception:  # died with its node
                    pass
        for i, (actor, _, _) in actors.items():
            if i not in alive:
                _kill(actor)
        return alive

    def release(self) -> None:
        for actor, _, _ in self.actors.values():
            _kill(actor)
        self.actors = {}


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass


class _HeldGroup:
    """The placement group kept across attempts: a restart re-uses it (the resources are never let go,
    so no other job can take them meanwhile, and Ray moves bundles off a dead node by itself); it is
    replaced only when it cannot be ready again in time. A group given by the caller is never removed."""

    def __init__(self, given=None):
        self.given, self.pg, self.bundles = given, given, None

    def release(self) -> None:
        if self.pg is not None and self.given is None:
            placement.release(self.pg)
        self.pg = None

    def get(self, spec: JobSpec, display: ProgressDisplay, elastic: bool):
        if self.given is not None:
            return self.given, placement.job_bundles(spec)
        if self.pg is not None:
            ready, _ = ray.wait([self.pg.ready()], timeout=spec.cluster.reserve_timeout_s)
            if ready:
                return self.pg, self.bundles
            display.message("raytf: the placement group did not come back in time; reserving anew")
            self.release()
        self.pg, self.bundles = _reserve(spec, display, elastic)
        return self.pg, self.bundles


def _attempt(job: Job, spec: JobSpec, payload: WorkerPayload, group_cls, env: dict, display: ProgressDisplay,
             result: Result, elastic: bool, epochs: EpochFeed, held: _HeldGroup, standby: "_StandbyPool"):
    """Reserve (or re-use the held group), start, rendezvous, train; always stop the actors.
    Returns (tasks, outcomes by rank)."""
    phase = _PhaseClock(result.phases, time.time())
    pg, bundles = held.get(spec, display, elastic)
    if spec.strategy == "mirrored" and len(bundles) != spec.cluster.workers:  # failure.elastic
        spec = _with_workers(spec, len(bundles))
        payload = dataclasses.replace(payload, spec=spec)
    result.workers = spec.cluster.workers
    if result.restarts:
        result.restarts[-1].update(resumed_from_step=payload.resume_from.step if payload.resume_from else 0,
                                   workers=spec.cluster.workers)
    phase.done("reserve_s")
    group = None
    try:
        warm = standby.take(pg, len(bundles))
        if result.restarts:
            result.restarts[-1]["standby"] = len(warm)  # warm processes promoted (0: all new)
        for rendezvous_attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            group = group_cls(pg, bundles, env, standby=warm) if warm else group_cls(pg, bundles, env)
            warm = {}
            try:
                tasks = _start(group, payload, spec.cluster.start_timeout_s)
            except PortTaken as exc:
                group.stop()
                if rendezvous_attempt == RENDEZVOUS_ATTEMPTS:
                    raise AttemptFailed(Failure("startup", str(exc), (), {str(exc): []})) from None
                display.message(f"raytf: {exc}; new rendezvous (attempt {rendezvous_attempt + 1})")
                continue
            except WorkerStartupError as exc:
                raise AttemptFailed(Failure("startup", str(exc), (), {str(exc): []})) from None
            result.rendezvous_attempts = rendezvous_attempt
            break
        phase.done("start_s")
        display.message("raytf: " + ", ".join(f"rank {t.rank}@{t.address}" + (f" gpu {','.join(t.gpu_ids)}" if t.gpu_ids else "")
                                               for t in tasks))
        if spec.strategy == "parameter_server":
            outcomes = _supervise_parameter_server(group, tasks, payload, display, epochs, result)
        else:
            # Warm processes for the next attempt import TensorFlow while the first one builds its model;
            # after a restart, only once it trains again (they would slow the recovery down).
            arm = lambda: standby.fill(pg, bundles, env, tasks)  # noqa: E731
            if not result.restarts:
                arm()
            outcomes = _supervise(group, tasks, payload, display, epochs, spec.failure.hang_timeout_s,
                                  on_training=arm if result.restarts else None)
        phase.done("train_s")
        return tasks, outcomes
    finally:
        if group is not None:
            group.stop()


def _start(group: WorkerGroup, payload: WorkerPayload, timeout_s: float) -> list[rendezvous.Task]:
    reports = group.start(timeout_s)
    if payload.spec.strategy == "parameter_server":
        tasks = rendezvous.assign_roles(reports, placement.bundle_roles(payload.spec))
    else:
        tasks = rendezvous.assign_ranks(reports)
    group.setup(tasks, payload, timeout_s)
    return tasks


def _supervise(group: WorkerGroup, tasks: list[rendezvous.Task], payload: WorkerPayload,
               display: ProgressDisplay, epochs: EpochFeed, hang_timeout_s: float,
               on_training: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Wait for every rank while showing progress; the first failure or a hang ends the attempt.
    `on_training()` is called once, when the chief has trained its first step."""
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
                _fail(tasks, rank_of, ref, exc, pending)
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
            message = f"training hung: no progress from rank(s) {stalled} for {hang_timeout_s:g}s (failure.hang_timeout_s)"
            raise AttemptFailed(Failure("hang", message, tuple(stalled), {message: stalled}),
                                sorted({tasks[r].node_ip for r in stalled}))
        if progress[0] is not None:
            epochs.feed(progress[0].get("epochs", []))
            if on_training is not None and progress[0].get("global_step", 0) > 0:
                on_training()
                on_training = None
        display.update(progress[0], rate.update(progress[0]))
    return [outcomes[rank] for rank in range(len(refs))]


def _supervise_parameter_server(group: WorkerGroup, tasks: list[rendezvous.Task], payload: WorkerPayload,
                                display: ProgressDisplay, epochs: EpochFeed, result: Result) -> list[dict[str, Any]]:
    """Wait for the chief (then the evaluator) while showing progress. A worker that dies is only a
    loss of capacity: the coordinator re-runs its step elsewhere, and raytf starts a replacement at the
    same address for the coordinator to take back. A dead ps task, a chief error or a chief without
    progress ends the attempt. The evaluator is a side-car: its failure is recorded, never fatal."""
    spec = payload.spec
    hang_timeout_s = spec.failure.hang_timeout_s
    refs = group.train(payload)
    task_of = {ref: t for ref, t in zip(refs, tasks)}
    awaited = [ref for ref in refs if task_of[ref].role in ("chief", "evaluator")]
    watched = [ref for ref in refs if task_of[ref].role in ("ps", "worker")]
    outcomes: dict[int, dict[str, Any]] = {}
    chief_seen = (None, time.time())
    chief_done_at: float | None = None
    replacing: list[_Replacement] = []
    replacements_left = 2 * spec.cluster.workers
    rate = _Rate()
    while awaited:
        done, _ = ray.wait(awaited + watched, num_returns=1, timeout=POLL_INTERVAL_S)
        for ref in done:
            task = task_of.pop(ref)
            try:
                outcomes[task.rank] = ray.get(ref)
            except Exception as exc:
                if task.role == "evaluator":
                    result.evaluations_error = describe(exc)
                    display.message(f"raytf: the evaluator failed ({result.evaluations_error}); training goes on")
                elif task.role == "worker":
                    watched.remove(ref)
                    loss = {"worker": task.index, "node_ip": task.node_ip, "at": round(time.time(), 3),
                            "cause": describe(exc), "replaced": False}
                    result.worker_losses.append(loss)
                    display.message(f"raytf: worker {task.index} on {task.node_ip} lost ({loss['cause']}); "
                                    f"the other workers go on")
                    if replacements_left > 0 and chief_done_at is None:
                        replacements_left -= 1
                        replacing.append(_Replacement(group, task, payload, loss))
                    continue
                else:
                    failure = failure_lib.aggregate([_rank_error(task.rank, exc)])
                    message = f"{task.role} {task.index} (rank {task.rank}, {task.node_ip}): {failure.message}"
                    raise AttemptFailed(dataclasses.replace(failure, message=message), [task.node_ip]) from None
            if ref in awaited:
                awaited.remove(ref)
            if task.role == "chief":
                chief_done_at = time.time()
        for replacement in [r for r in replacing if r.finished]:
            replacing.remove(replacement)
            if replacement.ref is not None:
                replacement.loss["replaced"] = True
                task_of[replacement.ref] = replacement.task
                watched.append(replacement.ref)
            display.message(f"raytf: worker {replacement.task.index} " +
                            (f"is back at {replacement.task.address}" if replacement.ref is not None
                             else f"could not be brought back ({replacement.error})"))
        if not awaited:
            break
        progress = group.progress(timeout_s=POLL_INTERVAL_S * 4)
        now = time.time()
        chief = progress[0]
        if chief is not None and chief_done_at is None:
            marker = (chief.get("phase"), chief.get("global_step"))
            if marker != chief_seen[0]:
                chief_seen = (marker, now)
            epochs.feed(chief.get("epochs", []))
            display.update(chief, rate.update(chief))
        if chief_done_at is None and now - chief_seen[1] > hang_timeout_s:
            message = f"training hung: no progress from the chief for {hang_timeout_s:g}s (failure.hang_timeout_s)"
            raise AttemptFailed(Failure("hang", message, (0,), {message: [0]}), [tasks[0].node_ip])
        if chief_done_at is not None and now - chief_done_at > hang_timeout_s:  # only the evaluator is left
            result.evaluations_error = (f"the evaluator did not finish within {hang_timeout_s:g}s "
                                        f"(failure.hang_timeout_s) after training ended")
            display.message(f"raytf: {result.evaluations_error}; stopping it")
            for ref in awaited:
                evaluator = task_of[ref]
                final = (progress[evaluator.rank] or {}).get("evaluations", [])
                outcomes[evaluator.rank] = {"evaluations": final, "history": []}
            break
    return [outcomes.get(t.rank, {}) for t in tasks]


class _Replacement:
    """A new actor for a dead worker, in its bundle and at its address (TF's cluster is fixed at start),
    started in a thread so the supervisor keeps watching meanwhile. `ref`: its train ref once set up."""

    def __init__(self, group: WorkerGroup, task: rendezvous.Task, payload: WorkerPayload, loss: dict):
        self.task, self.loss = task, loss
        self.ref, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(group, payload), daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    def _run(self, group: WorkerGroup, payload: WorkerPayload) -> None:
        try:
            self.ref = group.replace(self.task, payload, payload.spec.cluster.start_timeout_s)
        except Exception as exc:
            self.error = describe(exc)


def _rank_error(rank: int, exc: BaseException) -> failure_lib.RankError:
    cause = root_cause(exc)
    return failure_lib.RankError(rank, failure_lib.classify(type(cause).__name__, str(cause),
                                                            actor_died=isinstance(cause, RayActorError)),
                                 describe(exc))


def _fail(tasks: list[rendezvous.Task], rank_of: dict, failed_ref, exc: BaseException, pending: list) -> None:
    """Collect the peers' errors for a moment (often broken collectives, as a consequence), then raise
    the aggregate: root cause first, identical errors grouped by rank."""
    errors = [_rank_error(rank_of[failed_ref], exc)]
    # A dead actor explains its peers' trouble (they are stuck in a collective and would only time
    # out): don't wait for them. Otherwise give them a moment to report their own errors.
    grace = 0.0 if errors[0].kind == "actor_died" else PEER_ERROR_GRACE_S
    if pending:
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as peer_exc:
                errors.append(_rank_error(rank_of[ref], peer_exc))
    failure = failure_lib.aggregate(errors)
    raise AttemptFailed(failure, sorted({tasks[r].node_ip for r in failure.ranks}))


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

