"""`raytf results RUN`: a run's result.json read back from its storage (a local folder or a URI), told in a
few lines: its state and why, its epochs, its attempts, where its model is. No Ray, no TensorFlow.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from raytf.errors import SpecError
from raytf.storage import Folder, is_uri

RESULT = "result.json"


def locate(run: str, settings: Sequence[str] = ()) -> str:
    """Where RUN's results are: RUN is an output.dir (a path or a URI), a job file (its output.dir, after
    `--set`), or a run name with its results in runs/<name> here."""
    if is_uri(run):
        return run.rstrip("/")
    path = Path(run).expanduser()
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        from raytf.job import read_job

        return read_job(run, settings).output_where
    if path.is_dir():
        return str(path.resolve())
    if (Path("runs") / run).is_dir():
        return str((Path("runs") / run).resolve())
    raise SpecError(f"{run}: no such output.dir, job file or run under runs/; give the output.dir (a folder or a URI "
                    f"such as s3://bucket/runs/name) or the job file")


def read(where: str) -> dict[str, Any]:
    """The run's result.json; SpecError naming the place when there is none."""
    saved = Folder(where, "output.dir").read_json(RESULT)
    if not isinstance(saved, dict):
        raise SpecError(f"no result.json in {where}: no run has started there (or it is not raytf's output.dir)")
    return saved


def exit_code(saved: dict[str, Any]) -> int:
    """0 succeeded (or still running), 1 failed or interrupted."""
    return 0 if saved.get("status") in ("succeeded", "running") else 1


def describe(saved: dict[str, Any], where: str) -> str:
    """A few lines for a person: state and reason, last epoch, attempts, the model."""
    lines = [f"{saved.get('name')}: {saved.get('status')}" + (f" ({saved['error']})" if saved.get("error") else "")
             + f" -- {where}/{RESULT}"]
    history = saved.get("history") or []
    if history:
        last = history[-1]
        shown = "  ".join(f"{k} {v:.4f}" for k, v in last.items() if isinstance(v, float) and k != "seconds")
        lines.append(f"  {len(history)} epoch(s); epoch {last.get('epoch')}: {shown}")
    for attempt in saved.get("attempts") or []:
        cluster = (attempt.get("cluster") or {}).get("session", "?")
        lines.append(f"  attempt {attempt.get('attempt')}: {attempt.get('started')} .. {attempt.get('ended') or '?'} "
                     f"on {attempt.get('host')} ({cluster})"
                     + (f", from step {attempt['resumed_from_step']}" if attempt.get("resumed_from_step") else "")
                     + f": {attempt.get('ended_because') or 'running'}")
    for fmt, path in (saved.get("exports") or {}).items():
        lines.append(f"  {fmt}: {path}")
    if saved.get("tensorboard_dir"):
        lines.append(f"  tensorboard: {saved['tensorboard_dir']}")
    return "\n".join(lines)
