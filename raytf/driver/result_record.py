"""result.json's contents from what the controller saw: a succeeded attempt's outcomes, or what a run that ended
otherwise keeps, and the lines the terminal shows at the end. The record itself is raytf.driver.report.Result;
the controller (raytf.driver.controller) decides when, this module says what."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from raytf.driver import attempts, stragglers
from raytf.driver.callbacks import end_reason, end_state
from raytf.driver.report import Result, summary_table, worker_lines, write_artifacts
from raytf.job import Job
from raytf.protocol import Outcome
from raytf.rendezvous import Task


def task_entries(backend, tasks: list[Task], outcomes: dict[int, Outcome]) -> list[dict[str, Any]]:
    """result.json's tasks: where each ran, and what it returned (nothing yet, for a failed attempt)."""
    none = Outcome()
    return [dict(rank=t.rank, role=backend.role_name(t), index=t.index, node_ip=t.node_ip,
                 node_id=t.node_id, address=t.address, gpu_ids=list(t.gpu_ids),
                 cuda_visible_devices=t.cuda_visible_devices,
                 weights_digest=outcomes.get(t.rank, none).weights_digest,
                 steps=outcomes.get(t.rank, none).steps,
                 optimizer_steps=outcomes.get(t.rank, none).optimizer_steps)
            for t in tasks]


def succeeded(result: Result, job: Job, backend, tasks: list[Task], outcomes: dict[int, Outcome],
              worker_losses: list[dict[str, Any]], started: float) -> None:
    """`result` of the attempt that finished: the chief's history and exports, each task's entry and timing,
    the evaluator's results, throughput and stragglers. Each task's artifacts are written into output.dir
    (and dropped from `outcomes`: not held in memory twice)."""
    chief = outcomes[0]
    for rank, outcome in outcomes.items():
        write_artifacts(job.output_dir, outcome.artifacts)
        outcomes[rank] = dataclasses.replace(outcome, artifacts={})
    spec = job.spec
    result.status = "succeeded"
    result.history = chief.history
    result.variable_devices = chief.variable_devices
    recovered = chief.recovered_workers
    for loss in worker_losses:  # the coordinator took the replacement back
        loss["rejoined"] = any(d.endswith(f"/job:worker/replica:0/task:{loss['worker']}") for d in recovered)
    evaluator = [outcomes.get(t.rank, Outcome()) for t in tasks if t.role == "evaluator"]
    if evaluator:
        result.evaluations = evaluator[0].evaluations
        merge_evaluations(result.history, result.evaluations)
    result.tasks = task_entries(backend, tasks, outcomes)
    timing = {}  # "worker-<i>" -> its input wait and step time (each mirrored worker's own; the PS chief's)
    for outcome in outcomes.values():
        timing.update(outcome.timing)
    for task, entry in zip(tasks, result.tasks):
        if task.role == "worker":
            entry.update(timing.get(f"worker-{task.index}", {}))
    train_s = None
    if chief.first_step_at:
        result.time_to_first_step_s = round(chief.first_step_at - started, 3)
        train_s = chief.finished_at - chief.first_step_at
        steps_after_first = max((chief.steps_run or 0) - 1, 0)
        if train_s > 0 and steps_after_first:
            result.examples_per_s = round(steps_after_first * spec.train.effective_batch_size / train_s, 1)
    result.stragglers = stragglers.find([e for e in result.tasks if "timed_steps" in e], train_s,
                                        backend.synchronous_steps)
    result.exports = {fmt: job.output_location(rel) for fmt, rel in chief.exports.items()}
    result.model_path = result.exports.get("keras")
    result.model_load = chief.load_note
    tb_written = (job.output_dir / "tensorboard").exists()
    result.tensorboard_dir = job.output_location("tensorboard") if tb_written else None


def failed(result: Result, exc: BaseException, epochs_seen: list[dict[str, Any]], backend, tasks: list[Task],
           attempt) -> None:
    """A run that ends without success keeps what it did: the epochs it finished (across restarts), the tasks
    of its last attempt, the error and, where a task raised it, its traceback. A scheduler's stop is "stopped",
    with its reason."""
    result.status, result.error = end_state(exc), end_reason(exc)
    result.traceback = getattr(exc, "traceback", None)
    if not result.history:
        result.history = list(epochs_seen)
    if not result.tasks and tasks:
        result.tasks = task_entries(backend, tasks, attempt.outcomes if attempt is not None else {})
    for entry in result.tasks:  # every failing rank's own error and traceback, not only the root cause's
        entry.update(getattr(exc, "per_rank", {}).get(entry.get("rank"), {}))


def summary(spec, result: Result, synchronous: bool) -> list[str]:
    """What the terminal shows when a run succeeded: the epochs' table, what a train_fn did not hand raytf,
    how to load the model, the workers' time and who was slow."""
    lines = [summary_table(result.history), *train_fn_hints(spec, result)]
    if result.model_load:
        lines.append(f"raytf: {result.model_load}")
    if any(t.get("timed_steps") for t in result.tasks):
        lines.append(worker_lines(result.tasks))
    lines += ["raytf: " + stragglers.describe(slow, synchronous) for slow in result.stragglers]
    return lines


def train_fn_hints(spec, result: Result) -> list[str]:
    """What a train_fn that ran to its end did not hand raytf, and how it would."""
    if spec.train_fn is None:
        return []
    hints = []
    if not result.history:
        hints.append("raytf: the train_fn reported no epoch: call ctx.report(metrics) once per epoch (with Keras: "
                     "callbacks=[LambdaCallback(on_epoch_end=lambda epoch, logs: ctx.report(logs))])")
    if not result.exports and spec.output.export:
        hints.append("raytf: the train_fn saved no model: call ctx.save_model(model) on every worker at the end")
    return hints


def merge_evaluations(history: list[dict[str, Any]], evaluations: list[dict[str, Any]]) -> None:
    """The evaluator's val_* metrics into the epochs whose end-of-epoch checkpoint it evaluated."""
    by_epoch = {e["epoch"]: e for e in evaluations if "epoch" in e}
    for metrics in history:
        found = by_epoch.get(metrics.get("epoch"))
        if found:
            metrics.update({k: v for k, v in found.items() if k.startswith("val_")})


def restart(failure, nodes: list[str], now: float, charged: bool) -> dict[str, Any]:
    """One restart as result.json's `restarts` keep it (the attempt after it fills in what it resumed from;
    `charged`, against failure.max_restarts, is the controller's own and left out of result.json)."""
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)), "time": round(now, 3),
            "kind": failure.kind, "reason": failure.message, "ranks": list(failure.ranks), "nodes": nodes,
            "resumed_from_step": None, "charged": charged, **failure.details}


def close(result: Result, restarts: list[dict[str, Any]], worker_losses: list[dict[str, Any]], wall_s: float) -> None:
    """What result.json says however the run ended: its time, restarts and worker losses, its attempt ended."""
    result.wall_s = round(wall_s, 3)
    result.restarts = [{k: v for k, v in d.items() if k != "charged"} for d in restarts]
    result.worker_losses = list(worker_losses)
    if result.attempts:
        attempts.end(result.attempts[-1], result.status, result.error)
