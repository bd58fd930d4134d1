"""`raytf results RUN`: a run's result.json read back from its storage (a local folder or a URI), told in a
few lines: its state and why, its epochs, its attempts, where its model is. No Ray, no TensorFlow.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from raytf.errors import RaytfError, SpecError, clip
from raytf.storage import Folder, StorageError, is_uri

RESULT = "result.json"

# What `describe` and `exit_code` read, with the types raytf writes (raytf.driver.report.Result; None or absent
# is allowed): a result.json with other types is refused in one line, not met with a traceback halfway.
FIELDS = {"name": str, "status": str, "error": str, "history": list, "attempts": list, "exports": dict,
          "tensorboard_dir": str}
KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
         type(None): "null"}  # JSON's names, for messages


class StorageUnreadable(RaytfError):
    """The storage did not answer or refused (endpoint down, credentials refused). Exit 5, as `raytf status`
    when the Jobs API cannot be reached: 1 is the run's own "failed", which an outage must not pass for."""

    exit_code = 5


def locate(run: str, settings: Sequence[str] = ()) -> str:
    """Where RUN's results are: RUN is an output.dir (a path or a URI), a job file (its output.dir, after
    `--set`), or a run name with its results in runs/<name> here."""
    if is_uri(run):  # trailing slashes go, the scheme's "//" stays (`s3://` alone is said by Folder)
        scheme, rest = run.split("://", 1)
        return f"{scheme}://{rest.rstrip('/')}"
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
    """The run's result.json. SpecError (exit 2) when there is none or it is not raytf's; StorageUnreadable
    (exit 5) when the storage cannot be read (an endpoint down, credentials refused): each names the place and
    the fix."""
    try:
        data = Folder(where, "output.dir").read_bytes(RESULT)
    except SpecError:  # a URI pyarrow cannot open: RUN's fault
        raise
    except StorageError as exc:  # the store's own error, from raytf.storage: the environment, not RUN
        raise StorageUnreadable(f"cannot read {where}/{RESULT} ({_first_line(exc.cause)}); "
                                f"{_storage_fix(where, exc.cause)}") from None
    except RaytfError as exc:  # a store that did not answer in time, said by raytf.storage
        raise StorageUnreadable(str(exc)) from None
    except OSError as exc:  # pyarrow's errors from the store or the disk: the environment, not RUN
        raise StorageUnreadable(f"cannot read {where}/{RESULT} ({_first_line(exc)}); "
                                f"{_storage_fix(where, exc)}") from None
    except ValueError as exc:  # pyarrow's ArrowInvalid: a path it will not address (s3://bucket//x)
        raise SpecError(f"output.dir {where}: pyarrow refuses the path ({_first_line(exc)}); give the output.dir as "
                        f"raytf printed it (s3://bucket/runs/name, no empty parts)") from None
    if data is None:
        raise SpecError(f"no result.json in {where}: no run has started there (or it is not raytf's output.dir)")
    try:
        saved = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise SpecError(f"{where}/{RESULT} is not JSON ({_first_line(exc)}): a write cut short, or not raytf's file; "
                        f"restore it, or run the job again to write a new one") from None
    problem = shape_problem(saved)
    if problem:
        raise SpecError(f"{where}/{RESULT} is not a raytf result: {problem}; it was edited or is another program's "
                        f"file; restore it, or run the job again to write a new one")
    return saved


def shape_problem(saved: Any) -> str | None:
    """What in a parsed result.json has a type `describe` cannot show, or None."""
    if not isinstance(saved, dict):
        return f"it holds {_kind(saved)} where raytf writes an object"
    for key, kind in FIELDS.items():
        value = saved.get(key)
        if value is not None and not isinstance(value, kind):
            return f'"{key}" is {_shown(value)} ({_kind(value)}), not {KINDS[kind]}'
    for key in ("history", "attempts"):
        for item in saved.get(key) or []:
            if not isinstance(item, dict):
                return f'"{key}" holds {_shown(item)} ({_kind(item)}), not an object'
    for attempt in saved.get("attempts") or []:
        cluster = attempt.get("cluster")
        if cluster is not None and not isinstance(cluster, dict):
            return f'an attempt\'s "cluster" is {_shown(cluster)} ({_kind(cluster)}), not an object'
    return None


def _kind(value: Any) -> str:
    return KINDS.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    return clip(json.dumps(value), 80)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return clip(lines[0] if lines else type(exc).__name__)


def _storage_fix(where: str, exc: OSError) -> str:
    """The likely fix for a store that refused or did not answer, from pyarrow's (AWS SDK's) wording."""
    if not is_uri(where):
        return "check that this user may read it"
    if not where.startswith("s3://"):
        return "check the store's credentials and that this machine reaches it"
    said = str(exc)
    if any(code in said for code in ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                                     "EXPIRED_TOKEN", "Forbidden")):
        return ("the store refused the credentials: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "AWS_PROFILE), and that they may read this bucket")
    if "NETWORK_CONNECTION" in said or "Could not connect" in said or "resolve host" in said:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return f"the S3 endpoint {endpoint} (AWS_ENDPOINT_URL) does not answer: start it, or fix AWS_ENDPOINT_URL"
        return "AWS's S3 does not answer: check this machine's network (or set AWS_ENDPOINT_URL for another store)"
    return "check the endpoint (AWS_ENDPOINT_URL), the credentials and that the bucket exists"


def exit_code(saved: dict[str, Any]) -> int:
    """0 succeeded, still running, or stopped by a sweep's scheduler (its decision, not a failure); 1 failed or
    interrupted. (Before that, `read`: 2 nothing there or not raytf's, 5 the storage unreadable.)"""
    return 0 if saved.get("status") in ("succeeded", "running", "stopped") else 1


def describe(saved: dict[str, Any], where: str) -> str:
    """A few lines for a person: state and reason, last epoch, attempts, the model."""
    lines = [f"{saved.get('name')}: {saved.get('status')}" + (f" ({saved['error']})" if saved.get("error") else "")
             + f" -- {where}/{RESULT}"]
    history = saved.get("history") or []
    if history:
        last = history[-1]
        from raytf.driver.report import fmt

        shown = "  ".join(f"{k} {fmt(v)}" for k, v in last.items() if isinstance(v, float) and k != "seconds")
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
