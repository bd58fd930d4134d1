"""Checkpoints on any storage pyarrow.fs reaches: a local directory, s3://, gs://, hdfs://.

Layout: <checkpoint.dir>/ckpt-<global step, 12 digits>/ holds TensorFlow's checkpoint files and, written
last, `raytf.json` (step, epoch, position in the epoch, metrics history so far). A checkpoint without
`raytf.json` is incomplete (a crash mid-upload) and is never "latest". No TensorFlow import here: the
driver lists and prunes, workers copy files in and out.
"""
from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import sys
from typing import Any

import pyarrow.fs as pafs

from raytf.errors import RaytfError, SpecError, clip
from raytf.storage import TIMEOUT_S, endpoint_of, open_fs, probe_write, within

META = "raytf.json"
PREFIX = "ckpt-"
_warned: set[str] = set()  # checkpoints already said to be skipped: the listing is polled, the line said once


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: str  # full path or URI of the ckpt-N folder
    step: int  # global step the state is at (steps done)
    epoch: int  # 1-based epoch the next step belongs to
    step_in_epoch: int  # steps of that epoch already done
    history: tuple = ()  # per-epoch metrics of the epochs finished before this checkpoint
    world_size: int = 0


UNLISTED = object()  # resume_note's `latest` when the caller has not listed checkpoint.dir


def resume_note(checkpoint_dir: str | None, resume: "bool | str" = True,
                latest: "CheckpointInfo | None | object" = UNLISTED) -> str | None:
    """Before anything starts: --resume needs a checkpoint.dir (SpecError), and says when it holds nothing yet
    (the line returned); without --resume, a checkpoint.dir that holds checkpoints is a SpecError, so none is
    trained over by accident. resume "auto" (resume: auto) says which of the two it does. `latest`: the
    newest checkpoint, when the caller has listed the folder already (a listing reads every checkpoint's
    metadata: a run lists it once before its first step)."""
    if checkpoint_dir is None:
        if resume:
            raise SpecError("--resume: the job has no checkpoint.dir to resume from; set checkpoint.dir")
        return None
    if latest is UNLISTED:
        latest = Storage(checkpoint_dir).latest()
    if latest is not None and not resume:
        raise SpecError(f"checkpoint.dir {checkpoint_dir} already holds checkpoints (latest at step {latest.step}); "
                        f"pass --resume to continue from it, or choose another checkpoint.dir")
    if resume == "auto":
        if latest is None:
            return f"raytf: resume: auto: no checkpoint in {checkpoint_dir} yet; training from the start"
        return (f"raytf: resume: auto: continuing from step {latest.step} (epoch {latest.epoch}) in "
                f"{checkpoint_dir}")
    if latest is None and resume:
        return f"raytf: --resume: checkpoint.dir {checkpoint_dir} holds no checkpoint yet; training starts from scratch"
    return None


class Storage:
    """One checkpoint directory, addressed by a local path or a URI."""

    def __init__(self, location: str, timeout_s: float = TIMEOUT_S):
        self.location, self.timeout_s = location, timeout_s
        try:
            self.fs, self.root = self._within(lambda: open_fs(location), "opening it")
        except RaytfError:
            raise
        except Exception as exc:  # an unknown scheme, missing credentials, bad bucket name
            raise SpecError(f"checkpoint.dir: pyarrow cannot open {location!r} ({exc})") from None

    def _within(self, call, doing: str):
        """A call to a remote store under raytf.storage's deadline: a silent endpoint is an error, not a hang."""
        if "://" not in self.location:
            return call()
        return within(self.timeout_s, f"checkpoint.dir {self.location} ({endpoint_of(self.location)}, {doing})",
                      call)

    def _full(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def uri(self, path: str) -> str:
        """A path inside this storage, in the form the user gave (a URI stays a URI)."""
        if "://" in self.location:
            scheme = self.location.split("://", 1)[0]
            return f"{scheme}://{path}"
        return path

    def check_writable(self) -> None:
        """Create the directory and write and delete a probe file; SpecError naming the cause if not."""
        try:
            self._within(lambda: probe_write(self.fs, self.root), "writing a probe")
        except RaytfError:
            raise
        except Exception as exc:
            raise SpecError(f"checkpoint.dir: cannot write to {self.location!r} ({exc}); "
                            f"choose a writable directory or URI") from None

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first. A folder that does not exist holds none; a store that fails to
        list (down, throttling, refusing, silent past the deadline) is a RaytfError: read as "none", a restart
        would begin at step 0."""
        return self._within(self._list, "listing its checkpoints")

    def _folders(self) -> list[pafs.FileInfo]:
        """Every ckpt-* folder, complete or not."""
        try:
            entries = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except Exception as exc:
            raise self._unreadable("list its checkpoints", exc) from None
        return [e for e in entries
                if e.type == pafs.FileType.Directory and posixpath.basename(e.path.rstrip("/")).startswith(PREFIX)]

    def _list(self) -> list[CheckpointInfo]:
        found = []
        for entry in self._folders():
            name = posixpath.basename(entry.path.rstrip("/"))
            try:
                with self.fs.open_input_stream(posixpath.join(entry.path, META)) as f:
                    data = f.read()
            except FileNotFoundError:  # no raytf.json: incomplete (an upload cut short), or pruned meanwhile
                continue
            except Exception as exc:
                raise self._unreadable(f"read {name}/{META}", exc) from None
            info, problem = _parse(self.uri(entry.path), data)
            if info is None:
                _skip(self.uri(entry.path), problem)
                continue
            found.append(info)
        return sorted(found, key=lambda c: c.step)

    def _unreadable(self, doing: str, exc: Exception) -> RaytfError:
        lines = str(exc).strip().splitlines()
        cause = clip(lines[0] if lines else type(exc).__name__)
        fix = ("check the endpoint (AWS_ENDPOINT_URL), the credentials and the network, then run again"
               if "://" in self.location else "check that this user may read it")
        return RaytfError(f"checkpoint.dir {self.location}: cannot {doing} ({cause}); {fix}")

    def latest(self, exclude: set[str] = frozenset()) -> CheckpointInfo | None:
        usable = [c for c in self.list() if c.path not in exclude]
        return usable[-1] if usable else None

    def upload(self, local_dir: str, meta: dict[str, Any], files: list[str] | None = None) -> str:
        """Copy local_dir's files to ckpt-<step>/, then write raytf.json: the marker of a complete checkpoint.
        A complete checkpoint already at that step is never written into (it is returned as it is); an
        incomplete one (an upload cut short, before or while it wrote raytf.json) is replaced. `files`: the names
        the checkpoint must hold (default: what local_dir holds now); one missing, or none, fails the upload
        before raytf.json is written (a folder removed under a background upload)."""
        files = sorted(os.listdir(local_dir)) if files is None else files
        if not files:
            raise FileNotFoundError(f"{local_dir} holds no checkpoint files to upload")
        name = f"{PREFIX}{meta['step']:012d}"
        target = self._full(name)
        found = self.fs.get_file_info([target, posixpath.join(target, META)])
        if found[1].type == pafs.FileType.File and self._complete(target):
            return self.uri(target)
        if found[0].type == pafs.FileType.Directory:
            self.fs.delete_dir(target)
        self.fs.create_dir(target, recursive=True)
        for file in files:
            with open(os.path.join(local_dir, file), "rb") as src, \
                    self.fs.open_output_stream(posixpath.join(target, file)) as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
        with self.fs.open_output_stream(posixpath.join(target, META)) as f:
            f.write(json.dumps(meta).encode())
        return self.uri(target)

    def _complete(self, folder: str) -> bool:
        """Whether a checkpoint folder's raytf.json reads as one (a write cut short leaves it empty or half)."""
        with self.fs.open_input_stream(posixpath.join(folder, META)) as f:
            return _parse(self.uri(folder), f.read())[0] is not None

    def folders(self) -> list[str]:
        """Every checkpoint folder's path, complete or not (to clear a folder: `list` shows only complete ones)."""
        return [e.path for e in self._within(self._folders, "listing its folders")]

    def remove(self, path: str) -> None:
        """Delete one checkpoint folder (its URI or its path in this store); one already gone is no error."""
        try:
            self.fs.delete_dir(path.split("://", 1)[1] if "://" in path else path)
        except Exception:  # already gone
            pass

    def download(self, checkpoint: CheckpointInfo, local_dir: str) -> None:
        fs, path = open_fs(checkpoint.path)
        os.makedirs(local_dir, exist_ok=True)
        for entry in fs.get_file_info(pafs.FileSelector(path)):
            if entry.type != pafs.FileType.File:
                continue
            with fs.open_input_stream(entry.path) as src, \
                    open(os.path.join(local_dir, posixpath.basename(entry.path)), "wb") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)

    def prune(self, keep: int) -> None:
        """Delete all but the newest `keep` complete checkpoints (incomplete ones older than those too)."""
        try:
            complete = self.list()
        except RaytfError:  # the checkpoint just saved stands; the next save prunes
            return
        if len(complete) <= keep:
            return
        for old in complete[:-keep]:
            self.remove(old.path)


def _parse(path: str, data: bytes) -> tuple[CheckpointInfo | None, str]:
    """A checkpoint's raytf.json as CheckpointInfo, or None and what is wrong with it."""
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError):
        return None, "is not JSON (a write cut short)"
    if not isinstance(meta, dict):
        return None, "is not a JSON object"
    for key in ("step", "epoch", "step_in_epoch"):
        if key not in meta:
            return None, f'has no "{key}"'
    for key in ("step", "epoch", "step_in_epoch", "world_size"):
        value = meta.get(key, 0)
        if type(value) is not int or value < 0:  # bool is an int: excluded by the exact type
            return None, f'has "{key}": {clip(json.dumps(value), 80)}, not a whole number'
    history = meta.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return None, '"history" is not a list of objects'
    return CheckpointInfo(path=path, step=meta["step"], epoch=meta["epoch"], step_in_epoch=meta["step_in_epoch"],
                          history=tuple(history), world_size=meta.get("world_size", 0)), ""


def _skip(path: str, problem: str) -> None:
    """Say once, in one line, that a checkpoint is passed over (the one before it is used instead)."""
    if path in _warned:
        return
    _warned.add(path)
    print(f"raytf: skipping checkpoint {path}: its {META} {problem}; the checkpoint before it is used instead "
          f"(repair that {META} or remove the folder)", file=sys.stderr, flush=True)
