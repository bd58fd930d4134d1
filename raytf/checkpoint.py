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
from typing import Any

import pyarrow.fs as pafs

from raytf.errors import SpecError
from raytf.storage import open_fs, probe_write

META = "raytf.json"
PREFIX = "ckpt-"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    path: str  # full path or URI of the ckpt-N folder
    step: int  # global step the state is at (steps done)
    epoch: int  # 1-based epoch the next step belongs to
    step_in_epoch: int  # steps of that epoch already done
    history: tuple = ()  # per-epoch metrics of the epochs finished before this checkpoint
    world_size: int = 0


def resume_note(checkpoint_dir: str | None, resume: "bool | str" = True) -> str | None:
    """Before anything starts: --resume needs a checkpoint.dir (SpecError), and says when it holds nothing yet
    (the line returned); without --resume, a checkpoint.dir that holds checkpoints is a SpecError, so none is
    trained over by accident. resume "auto" (resume: auto) says which of the two it does."""
    if checkpoint_dir is None:
        if resume:
            raise SpecError("--resume: the job has no checkpoint.dir to resume from; set checkpoint.dir")
        return None
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

    def __init__(self, location: str):
        self.location = location
        try:
            self.fs, self.root = open_fs(location)
        except Exception as exc:  # an unknown scheme, missing credentials, bad bucket name
            raise SpecError(f"checkpoint.dir: pyarrow cannot open {location!r} ({exc})") from None

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
            probe_write(self.fs, self.root)
        except Exception as exc:
            raise SpecError(f"checkpoint.dir: cannot write to {self.location!r} ({exc}); "
                            f"choose a writable directory or URI") from None

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first."""
        try:
            entries = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except Exception:
            return []
        found = []
        for entry in entries:
            name = posixpath.basename(entry.path.rstrip("/"))
            if entry.type != pafs.FileType.Directory or not name.startswith(PREFIX):
                continue
            try:
                with self.fs.open_input_stream(posixpath.join(entry.path, META)) as f:
                    meta = json.loads(f.read())
            except Exception:  # no raytf.json: incomplete, or not ours
                continue
            found.append(CheckpointInfo(path=self.uri(entry.path), step=meta["step"], epoch=meta["epoch"],
                                        step_in_epoch=meta["step_in_epoch"], history=tuple(meta.get("history", ())),
                                        world_size=meta.get("world_size", 0)))
        return sorted(found, key=lambda c: c.step)

    def latest(self, exclude: set[str] = frozenset()) -> CheckpointInfo | None:
        usable = [c for c in self.list() if c.path not in exclude]
        return usable[-1] if usable else None

    def upload(self, local_dir: str, meta: dict[str, Any]) -> str:
        """Copy local_dir's files to ckpt-<step>/, then write raytf.json: the marker of a complete checkpoint.
        A complete checkpoint already at that step is never written into (it is returned as it is); an
        incomplete one (an upload cut short) is replaced."""
        name = f"{PREFIX}{meta['step']:012d}"
        target = self._full(name)
        found = self.fs.get_file_info([target, posixpath.join(target, META)])
        if found[1].type == pafs.FileType.File:
            return self.uri(target)
        if found[0].type == pafs.FileType.Directory:
            self.fs.delete_dir(target)
        self.fs.create_dir(target, recursive=True)
        for file in sorted(os.listdir(local_dir)):
            with open(os.path.join(local_dir, file), "rb") as src, \
                    self.fs.open_output_stream(posixpath.join(target, file)) as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
        with self.fs.open_output_stream(posixpath.join(target, META)) as f:
            f.write(json.dumps(meta).encode())
        return self.uri(target)

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
        complete = self.list()
        if len(complete) <= keep:
            return
        for old in complete[:-keep]:
            path = old.path.split("://", 1)[1] if "://" in old.path else old.path
            try:
                self.fs.delete_dir(path)
            except Exception:  # already gone
                pass
