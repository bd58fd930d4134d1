"""A run's output.dir, before anything starts: checked usable, held by one run at a time, and cleared of an
earlier run's results so that a new run's result.json never sits beside an older run's model.

output.dir may be a URI (s3://, gs://, hdfs://): the run then writes into a local staging folder
(`Job.output_dir`) and everything in it is shipped up to the URI when the run ends, however it ends.

No Ray, no TensorFlow: the driver calls `claim(job)` around the whole run.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

from raytf.errors import RaytfError, SpecError, clip
from raytf.job import Job
from raytf.storage import Folder, is_uri

LOCK = ".raytf-lock"
EARLIER = "earlier-runs"  # an earlier run's results, moved aside (never deleted): earlier-runs/<when>/
# What a run writes into output.dir (raytf.actor.export, raytf.driver.report), and so what an earlier run left.
RESULTS = ("result.json", "model.keras", "saved_model", "tensorboard")


def check(job: Job) -> Path:
    """output.dir (local) is a folder raytf may write, apart from the job's code and data; SpecError naming
    the problem otherwise. Returns it."""
    out = job.output_dir
    where = f"output.dir {out}"
    try:
        exists_as_file = out.exists() and not out.is_dir()
    except OSError as exc:  # e.g. a name too long for the file system
        raise SpecError(f"{clip(where, 200)} cannot be used ({exc.strerror}); give a shorter or other path") from None
    if exists_as_file:
        raise SpecError(f"{where} is a file, not a folder; give a folder (default: runs/<name> in the job folder)")
    job_dir = Path(job.job_dir).resolve()
    resolved = out.resolve()
    if _holds(resolved, job_dir):
        raise SpecError(f"{where} is the job folder{'' if resolved == job_dir else ' or holds it'}: results would "
                        f"land among the job's code and be uploaded with it; use a folder of its own, e.g. runs/<name>")
    for key, data in _data_paths(job):
        if _holds(resolved, data) or _holds(data, resolved):
            raise SpecError(f"{where} overlaps data.{key} ({data}): the data would be left out of the job's "
                            f"package and results written among it; give output.dir a folder of its own")
    probe = resolved / f".raytf-probe-{uuid.uuid4().hex}"
    try:
        resolved.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise SpecError(f"{where} cannot be written ({exc.strerror or exc}); give a folder you can write") from None
    return resolved


def check_checkpoint_dir(job: Job) -> None:
    """A local checkpoint.dir is not the job folder or above it, and not overlapping the data."""
    if job.checkpoint_dir is None or "://" in job.checkpoint_dir:
        return
    where, resolved = f"checkpoint.dir {job.checkpoint_dir}", Path(job.checkpoint_dir).resolve()
    job_dir = Path(job.job_dir).resolve()
    if _holds(resolved, job_dir):
        raise SpecError(f"{where} is the job folder{'' if resolved == job_dir else ' or holds it'}: checkpoints would "
                        f"land among the job's code; use a folder of their own, e.g. ../runs/<name>/checkpoints")
    for key, data in _data_paths(job):
        if _holds(resolved, data) or _holds(data, resolved):
            raise SpecError(f"{where} overlaps data.{key} ({data}); give checkpoint.dir a folder of its own")


def _holds(folder: Path, path: Path) -> bool:
    """Whether `path` is `folder` or lies inside it (both resolved)."""
    return path == folder or folder in path.parents


def _data_paths(job: Job) -> list[tuple[str, Path]]:
    """The local data paths of the job (resolved), by key."""
    if job.spec.data is None:
        return []
    paths = [(key, getattr(job.spec.data, key)) for key in ("train", "validation")]
    return [(key, Path(job.data_path(p)).resolve()) for key, p in paths if p is not None and "://" not in p]


@contextlib.contextmanager
def claim(job: Job, resume: bool = False) -> Iterator[Path]:
    """Hold output.dir for this run: check it, lock it (a second run into it is a SpecError naming the first),
    and move an earlier run's results aside to earlier-runs/<when>/, unless this run resumes that one (its
    TensorBoard events go on in the same folder). The lock goes with the process."""
    out = check(job)
    check_checkpoint_dir(job)
    handle = open(out / LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise SpecError(f"output.dir {out} is in use by another run ({holder}); wait for it to end, or give this "
                        f"run another output.dir (--set output.dir=...)") from None
    remote = Folder(job.output_where) if is_uri(job.output_where) else None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
        handle.flush()
        if remote is not None:
            if any(entry.name != LOCK for entry in out.iterdir()):
                ship(out, remote)  # an earlier run's results that never got there: now, or an error keeps them
            _empty(out)
        if not resume:
            move_earlier(remote or Folder(str(out)))
        try:
            yield out
        except BaseException:
            if remote is not None:
                ship(out, remote, failing=True)
            raise
        if remote is not None:
            ship(out, remote)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out / LOCK)
        handle.close()
        if remote is not None:  # an emptied staging folder goes too (one with unshipped results stays)
            with contextlib.suppress(OSError):
                out.rmdir()


def ship(staging: Path, remote: Folder, failing: bool = False) -> list[str]:
    """Copy the staged results up to output.dir, then empty the staging folder. If that fails the files
    stay where they are and the error says where (a run that already failed keeps its own error)."""
    from raytf.driver.packaging import OUTPUT_MARKER

    try:
        copied = remote.upload(staging, skip=(LOCK, OUTPUT_MARKER))
    except Exception as exc:
        said = (f"the run's results could not be written to output.dir {remote.where} ({exc}); they are kept in "
                f"{staging} (the next run into it tries again)")
        if failing:  # the run's own error comes after this line
            print(f"raytf: {said}", file=sys.stderr, flush=True)
            return []
        raise RaytfError(said) from None
    _empty(staging)
    return copied


def _empty(folder: Path) -> None:
    """Delete everything in `folder` but its lock."""
    import shutil

    for entry in folder.iterdir():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()


def move_earlier(folder: Folder) -> str | None:
    """An earlier run's results in output.dir, on a disk or in a bucket, go to earlier-runs/<when>/ (checkpoints
    stay for --resume). Returns where they went."""
    found = [name for name in RESULTS if folder.exists(name)]
    if not found:
        return None
    target = f"{EARLIER}/{_earlier_when(folder, found[0])}"
    while folder.exists(target):
        target += "-1"
    for name in found:
        folder.move(name, f"{target}/{name}")
    return folder.location(target)


def _earlier_when(folder: Folder, first: str) -> str:
    """The earlier run's time: on a disk, when its first result was written; in a bucket (where copying
    and a store's clock make that less telling), when that run started, as its result.json says (now, if not)."""
    if not folder.remote:
        return time.strftime("%Y%m%d-%H%M%S", time.localtime(os.stat(folder.location(first)).st_mtime))
    started = (((folder.read_json("result.json") or {}).get("attempts") or [{}])[-1] or {}).get("started")
    try:
        return time.strftime("%Y%m%d-%H%M%S", time.strptime(str(started), "%Y-%m-%dT%H:%M:%S%z"))
    except ValueError:
        return time.strftime("%Y%m%d-%H%M%S")
