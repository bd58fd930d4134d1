"""A sweep's results, collected on the driver once Tune is done: one row per trial from Tune's records and each
trial's result.json, the best trial as a job spec, the table, sweep.json and sweep.png (raytf.sweep_report
draws them). A trial whose process died before it could close its result.json is closed here.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import os
from pathlib import Path
from typing import Any

from raytf import learning_rate, sweep, sweep_report
from raytf.job import Job
from raytf.spec import JobSpec
from raytf.storage import Folder
from raytf.sweep_plan import BEST_SPEC, RESTORES, PreparedSweep, Suggested, UnrunnablePoint, point_of, trial_bundles, trial_name
from raytf.sweep_report import SweepResult


def _trial_point(prepared: PreparedSweep, suggested: Suggested | None, trial) -> tuple[sweep.Point, Job | None, str | None]:
    """A Tune trial's point, its job, and why it could not run (a suggested point only)."""
    pid = point_of(trial, prepared.section)
    if suggested is None:
        return next(p for p in prepared.points if p.id == pid), prepared.jobs[pid], None
    point = suggested.point(pid, trial.config)
    try:  # the spec only: the cluster of now may not be the one the trial met (an autoscaler, a resume)
        job = suggested.job(point, check_storage=False, check_fit=False)
    except UnrunnablePoint as exc:
        return point, None, str(exc)
    failed = _error_line(trial) if trial.status == "ERROR" else ""
    if f"{UnrunnablePoint.__name__}: " in failed:  # the trial found no set of nodes to hold it
        return point, None, failed.split(f"{UnrunnablePoint.__name__}: ", 1)[1]
    return dataclasses.replace(point, learning_rate=learning_rate.peak(job.spec)), job, None


def _planned_epochs(spec: JobSpec | None, epochs: int, saved: dict[str, Any]) -> int:
    """The epochs a trial was to run: train.epochs for raytf's loop; a train_fn counts its own, and its job
    succeeding is what says it ran them all."""
    if spec is None:
        return epochs
    if spec.train_fn is None:
        return spec.train.epochs
    return epochs if saved.get("status") == "succeeded" else epochs + 1


def collect(prepared: PreparedSweep, experiment: str, limit: int, started: float, wall: float,
             cluster_cpus: float, suggested: Suggested | None = None) -> SweepResult:
    """Rows from Tune's stored trials and raytf's result.json files; then every output of the sweep."""
    from ray.tune import ExperimentAnalysis

    section = prepared.section
    analysis = ExperimentAnalysis(experiment, default_metric=section.metric, default_mode=section.mode)
    by_point = {}
    rows = []
    for trial in analysis.trials:
        point, job, unrunnable = _trial_point(prepared, suggested, trial)
        by_point[point.id] = point
        history = _history(_reports(prepared, analysis, trial), section.metric)
        last = trial.last_result or {}
        epochs = int(last.get("epoch", len(history)) or 0)
        spec = job.spec if job is not None else None
        saved = Folder(job.output_where, "output.dir").read_json("result.json") or {} if job is not None else {}
        if saved.get("status") == "running":  # the trial's process died before it could close its run
            saved = _close_lost(job, saved, trial)
        rows.append({
            "point": point.id, "trial_id": trial.trial_id,
            "status": sweep_report.UNRUNNABLE if unrunnable else
            sweep_report.trial_status(trial.status, epochs, _planned_epochs(spec, epochs, saved)),
            "config": point.values,
            "global_batch_size": point.values.get("train.global_batch_size",
                                                  prepared.base.spec.train.global_batch_size) if spec is None
            else spec.train.global_batch_size,
            # the rate raytf's loop trained with; a train_fn's optimizer is its own (the spec's would mislead)
            "learning_rate": learning_rate.peak(spec) if spec is not None and spec.train_fn is None else None,
            "workers": (spec or prepared.base.spec).cluster.workers,
            "final": history[-1] if history else None,
            "best": sweep_report.best_of(history, section.mode),
            "history": history,
            "epochs": epochs,
            "time_s": last.get("time_total_s"),
            "reported_at": last.get("timestamp"),  # the last report, seconds since the epoch
            "cpus": sum(b.get("CPU", 0) for b in trial_bundles(spec)) if spec is not None else 0,
            "output_dir": job.output_where if job is not None else None,
            "model_path": saved.get("model_path"),
            "exports": saved.get("exports", {}),
            # each start from a checkpoint Tune handed back: after which epoch, from which trial (itself after a
            # hyperband pause; a better one in pbt's exploit), at which step, with which values
            "restores": Folder(job.output_where, "output.dir").read_json(RESTORES) or [] if job is not None else [],
            "error": unrunnable or (_error_line(trial) if trial.status == "ERROR" else None),
        })
    rows.sort(key=lambda r: r["point"])
    best = sweep_report.best_row(rows, section.mode)
    out = prepared.output_dir
    best_spec_path = None
    if best is not None:
        point = by_point[best["point"]]
        # It lives in output.dir, so base_dir points back at the job folder (its code, its data) and
        # output.dir (relative to that folder) at <sweep output>/best. In object storage it is read from
        # anywhere: base_dir is the job folder's absolute path and output.dir a URI.
        if prepared.remote:
            rel_out, base_dir = f"{prepared.output_where}/best", str(prepared.base.job_dir)
            run_it = f"download {prepared.output_where}/{BEST_SPEC}, then raytf run {BEST_SPEC}"
        else:
            rel_out = _relative(out / "best", prepared.base.job_dir)
            base_dir = _relative(prepared.base.job_dir, prepared.best_spec_path.parent)
            run_it = f"raytf run {_relative(prepared.best_spec_path, Path.cwd())}"
        header = (f"The best trial of the sweep {prepared.source} ({best['point']}: {section.metric} "
                  f"{best['final']:.4g} after {best['epochs']} epochs).\n"
                  + (f"Its model came through pbt's exploits (trials/{best['point']}/restores.json): these are its "
                     f"last values, and training them from scratch need not reach the same model.\n"
                     if best.get("restores") and any(r["from"] != best["point"] for r in best["restores"]) else "")
                  + f"Run it: {run_it}")
        text = sweep_report.best_spec_yaml(prepared.job_raw, {**point.overrides, "name": f"{prepared.base.spec.name}-best",
                                                          "base_dir": base_dir, "output.dir": rel_out}, header)
        sweep_report.write_text(prepared.best_spec_path, text)
        best_spec_path = prepared.location(BEST_SPEC)
    # Utilization of this run only: trials that finished in an earlier run (before a resume) do not count.
    busy = sum((r["time_s"] or 0) * r["cpus"] for r in rows if (r["reported_at"] or 0) >= int(started))
    utilization = busy / (wall * cluster_cpus) if wall > 0 and cluster_cpus > 0 else None
    space_keys = list(section.space)
    text_table = sweep_report.table(rows, section.metric, space_keys, best)
    plot_path = sweep_report.plot(rows, section.metric, section.mode, out / "sweep.png",
                                  f"{prepared.base.spec.name}: final {section.metric} ({section.mode})")
    result = SweepResult(
        name=prepared.base.spec.name, metric=section.metric, mode=section.mode, output_dir=prepared.output_where,
        rows=rows,
        best=best, best_spec_path=best_spec_path, best_model_path=best["model_path"] if best else None,
        best_exports=best["exports"] if best else {},
        sweep_json=prepared.location("sweep.json"), plot_path=prepared.location("sweep.png") if plot_path else None,
        table=text_table,
        max_concurrent_trials=limit, rejected=prepared.rejected, wall_s=round(wall, 3),
        utilization=None if utilization is None else round(utilization, 4),
        interrupted=any(r["status"] == sweep_report.UNFINISHED for r in rows) or len(rows) < prepared.num_trials,
        search={"algorithm": section.search.algorithm, "path": sweep_report.search_path(rows, section.mode),
                "lineage": sweep_report.lineage(rows)})
    sweep_report.write_json(out / "sweep.json", result.to_dict())
    return result


def _close_lost(job: Job, saved: dict[str, Any], trial) -> dict[str, Any]:
    """A trial's result.json left "running" by a process that ended without closing it (killed mid-epoch, its
    node gone): failed, with Tune's word for why, and its attempt ended. Tune has finished with the trial."""
    from raytf.driver import attempts
    from raytf.driver.report import Result

    result = Result.from_dict(saved)
    result.status = "failed"
    result.error = (f"the trial's process ended before it closed its run ({_error_line(trial)})"
                    if trial.status == "ERROR" else f"the trial ended ({trial.status}) before it closed its run")
    if result.attempts:
        attempts.end(result.attempts[-1], result.status, result.error)
    Folder(job.output_where, "output.dir").write_bytes("result.json", result.json_text().encode())
    return result.to_dict()


def _reports(prepared: PreparedSweep, analysis, trial) -> list[dict[str, Any]]:
    """A trial's reports as Tune wrote them to its progress.csv. (ExperimentAnalysis's dataframe of a trial Tune
    paused and restored can miss reports: it was seen holding one epoch of two.)"""
    text = Folder(prepared.experiment, "output.dir").read_bytes(f"{trial_name(trial, prepared.section)}/progress.csv")
    if text:
        return list(csv.DictReader(io.StringIO(text.decode())))
    frame = analysis.trial_dataframes.get(trial.trial_id)
    return frame.to_dict("records") if frame is not None else []


def _history(reports: list[dict[str, Any]], metric: str) -> list[float]:
    """The metric per epoch, in order. A trial run again after a resume may have reported an epoch twice:
    the later report wins."""
    def number(value) -> float | None:  # NaN stays (a diverged epoch); missing or empty is None
        try:
            return float(value)
        except (TypeError, ValueError):
            return None

    values = [(number(r.get("epoch")), number(r.get(metric))) for r in reports]
    values = [(None if e != e else e, v) for e, v in values]  # e != e: a NaN epoch
    if any(e is None for e, v in values if v is not None):  # reports without epochs: in order
        return [v for _, v in values if v is not None]
    by_epoch = {int(e): v for e, v in values if v is not None}
    return [by_epoch[e] for e in sorted(by_epoch)]


def _relative(path: Path, base: Path) -> str:
    try:
        return os.path.relpath(path, base)
    except ValueError:  # another drive
        return str(path)


def _error_line(trial) -> str:
    """The last line of the trial's error (the exception and its message)."""
    try:
        text = trial.get_error() or ""
    except OSError:
        text = ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else "failed"
