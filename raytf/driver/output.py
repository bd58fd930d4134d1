"""A run's output.dir, before anything starts: checked usable, held by one run at a time, and cleared of an
earlier run's results so that a new run's result.json never sits beside an older run's model.

output.dir may be a URI (s3://, gs://, hdfs://): the run then writes into a local staging folder
(`Job.output_dir`) and everything in it is shipped up to the URI when the run ends, however it ends.

No Ray, no TensorFlow: the driver calls `claim(job)` around the whole run.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from raytf.errors import RaytfError, SpecError, clip
from raytf.job import Job
from raytf.driver.lease import LeaseLost
from raytf.storage import STAGING_MARK, Folder, first_line, is_uri, new_staging, own_staging

if TYPE_CHECKING:
    from raytf.driver.lease import Lease

LOCK = ".raytf-lock"
EARLIER = "earlier-runs"  # an earlier run's results, moved aside (never deleted): earlier-runs/<when>/
# What a run writes into output.dir (raytf.actor.export, raytf.driver.report), and so what an earlier run left.
RESULTS = ("result.json", "model.keras", "saved_model", "tensorboard", "outputs", "hangs")


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
def claim(job: Job, resume: bool = False, lease: "Lease | None" = None) -> Iterator[Job]:
    """Hold output.dir for this run and yield the job as it writes its results, whatever ends it.

    A local output.dir is checked, locked (a second run into it is a SpecError naming the first; the lock goes
    with the process) and an earlier run's results are moved aside to earlier-runs/<when>/, unless this run
    resumes that one (its TensorBoard events go on in the same folder).

    A URI output.dir (held across machines by `lease`, if given) gets a fresh private staging folder on this
    machine, recorded in the lease; everything staged is shipped up when the run ends, result.json last."""
    if not is_uri(job.output_where):
        with _locked(job) as out:
            if not resume:
                move_earlier(Folder(str(out)))
            yield job
        return
    check_checkpoint_dir(job)
    remote = Folder(job.output_where)
    staging, token = new_staging(job.spec.name)
    try:
        if lease is not None:  # a driver killed from here on leaves a folder the next run here can find
            lease.note(staging=str(staging), token=token)
        if not resume:
            move_earlier(remote)
        try:
            yield dataclasses.replace(job, staging=staging)
        except BaseException:
            _finish(staging, remote, lease, failing=True)
            raise
        _finish(staging, remote, lease)
    finally:
        if not _holds_results(staging):  # shipped (or nothing written): gone
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _locked(job: Job) -> Iterator[Path]:
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
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
        handle.flush()
        yield out
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out / LOCK)
        handle.close()


def _finish(staging: Path, remote: Folder, lease: "Lease | None", failing: bool = False) -> None:
    """Ship the staged results, unless another driver took the run over meanwhile (then only the lease holder
    writes result.json: this run's results stay in the staging folder, and the terminal says where)."""
    try:
        taken = lease is not None and not lease.holds()
    except Exception:  # noqa: BLE001 -- the store is away: ship says so, and where the files are
        taken = False
    if taken:
        said = (f"output.dir {remote.where} was taken over by another run ({lease.lost}) while this one went on; "
                f"its results are kept in {staging}")
        if failing:
            print(f"raytf: {said}", file=sys.stderr, flush=True)
            return
        raise LeaseLost(said)
    ship(staging, remote, failing=failing)
    if lease is not None and not _holds_results(staging):  # all shipped: nothing for a later run to find
        with contextlib.suppress(Exception):
            lease.note(staging=None, token=None)


def _holds_results(staging: Path) -> bool:
    return any(p.name != STAGING_MARK for p in staging.iterdir())


def ship(staging: Path, remote: Folder, failing: bool = False) -> list[str]:
    """Copy the staged results up to output.dir, result.json last, then empty the staging folder. If that
    fails or is interrupted (Ctrl-C, SIGTERM: at once), the files stay where they are, the terminal says where,
    and result.json in output.dir says what happened (never "running"). A run that already failed keeps its
    own error; an interrupted upload goes on as the interruption."""
    from raytf.driver.packaging import OUTPUT_MARKER

    try:
        copied = remote.upload(staging, skip=(LOCK, OUTPUT_MARKER, STAGING_MARK), last=("result.json",))
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        why = "interrupted" if interrupted else first_line(exc)
        said = (f"the run's results could not all be written to output.dir {remote.where} ({why}); they are kept "
                f"in {staging} on {socket.gethostname()} (the next run into this output.dir on this machine ships "
                f"them)")
        print(f"raytf: {said}", file=sys.stderr, flush=True)
        _say_unshipped(staging, remote, "interrupted" if interrupted else "failed", said)
        if interrupted:
            raise
        if failing:  # the run's own error comes after the line above
            return []
        raise RaytfError(said) from None
    _empty(staging)
    return copied


def _say_unshipped(staging: Path, remote: Folder, status: str, said: str, timeout_s: float = 5.0) -> None:
    """result.json in output.dir says that the results stayed behind (the staged one, or the "running" one
    written at the start, closed): a store that cannot take even that now is left as it is."""
    from raytf.driver import attempts

    try:
        result = json.loads((staging / "result.json").read_text())
    except (OSError, ValueError):
        result = None
    try:
        quick = copy.copy(remote)  # the same client (a new one would look the bucket up again), a shorter deadline
        quick.timeout_s = timeout_s
        result = result if isinstance(result, dict) else quick.read_json("result.json")
        if not isinstance(result, dict):
            return
        if result.get("status") in ("running", "succeeded"):
            result["status"], result["error"] = status, said
        tries = [a for a in result.get("attempts") or [] if isinstance(a, dict)]
        if tries and not tries[-1].get("ended"):
            attempts.end(tries[-1], status, said)
        quick.write_json("result.json", result)
    except BaseException:  # noqa: BLE001 -- a second signal, a dead store: the terminal line said it all
        pass


def ship_leftover(remote: Folder, lease: "Lease") -> str | None:
    """Results an earlier attempt on this machine staged and never got up (killed, or its store away), found
    by the lease it left (never by a guessable path): shipped now, then that folder goes. Returns a line to say."""
    from raytf.driver.lease import pid_alive

    previous = lease.previous
    if not isinstance(previous, dict) or previous.get("host") != socket.gethostname():
        return None
    pid = previous.get("pid")
    if not previous.get("released") and isinstance(pid, int) and pid_alive(pid):  # lapsed, but still writing there
        return None
    folder = own_staging(previous.get("staging"), previous.get("token"))
    if folder is None:
        return None
    lease.note(staging=previous["staging"], token=previous["token"])  # if this ship fails, the next run finds them
    copied = ship(folder, remote)
    shutil.rmtree(folder, ignore_errors=True)
    lease.note(staging=None, token=None)
    return (f"raytf: shipped {len(copied)} file(s) an earlier attempt left in {folder} to output.dir {remote.where}"
            if copied else None)


def _empty(folder: Path) -> None:
    """Delete everything in `folder` but its lock and its staging mark. rmtree does not follow links."""
    for entry in folder.iterdir():
        if entry.name in (LOCK, STAGING_MARK):
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
