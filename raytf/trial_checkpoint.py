"""A sweep trial's raytf checkpoint handed to Tune and taken back, for the schedulers that stop a trial and
start it again (hyperband's pause and promotion, pbt's exploit).

Each epoch's report carries a copy of the checkpoint raytf saved at that epoch's end (every file of
`ckpt-<step>/`, plus `origin.json`: which point, step and epoch). Tune keeps it with the trial; when it starts
the trial again (promoted, or given a better trial's state by pbt) the copy is put back as the only
checkpoint in the trial's checkpoint.dir and the job resumes from it: every epoch is trained once, and an
exploit starts exactly where the donor's report was."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

from raytf.checkpoint import META, CheckpointInfo, Storage

ORIGIN = "origin.json"


def at_epoch_end(storage: Storage, epoch: int, deadline_s: float = 120.0, poll_s: float = 0.2) -> CheckpointInfo | None:
    """The checkpoint saved when `epoch` (1-based) ended, once it is complete; None after the deadline. The
    epoch's metrics can reach the driver a moment before the checkpoint's last file is written."""
    end = time.monotonic() + deadline_s
    while True:
        found = [c for c in storage.list() if c.epoch == epoch + 1 and c.step_in_epoch == 0]
        if found:
            return found[-1]
        if time.monotonic() > end:
            return None
        time.sleep(poll_s)


def drop_before(storage: Storage, checkpoint: CheckpointInfo) -> None:
    """Delete the trial's checkpoints older than `checkpoint` (Tune holds the one reported)."""
    for old in storage.list():
        if old.step < checkpoint.step:
            storage.remove(old.path)


def clear(storage: Storage) -> None:
    """Delete every checkpoint folder of the trial, complete or not (they must go: the trial resumes from what is
    left, and a folder cut short at the step handed back would otherwise stand in for it)."""
    for path in storage.folders():
        storage.remove(path)  # one that stays is named below
    left = storage.folders()
    if left:
        raise RuntimeError(f"checkpoint.dir {storage.location}: could not remove {', '.join(left)} before the "
                           f"hand-back; the trial would not resume from the checkpoint Tune gave it")


def pack(storage: Storage, checkpoint: CheckpointInfo, point: str, values: dict[str, Any]) -> str:
    """A local folder holding the checkpoint's files and where it came from (the point, its values, the step
    and the last epoch it holds), for tune.report (the caller removes it once reported)."""
    folder = tempfile.mkdtemp(prefix="raytf-trial-ckpt-")
    storage.download(checkpoint, folder)
    with open(os.path.join(folder, ORIGIN), "w") as f:
        json.dump({"point": point, "config": values, "step": checkpoint.step, "epoch": checkpoint.epoch - 1}, f)
    return folder


def unpack(folder: str, storage: Storage) -> dict[str, Any]:
    """Make the packed checkpoint the only one in `storage` (a later one of this trial's own, or one of its
    state before an exploit, would be resumed from instead). Returns its origin: point, config, step, epoch
    (the last epoch it holds)."""
    with open(os.path.join(folder, ORIGIN)) as f:
        origin = json.load(f)
    with open(os.path.join(folder, META)) as f:
        meta = json.load(f)
    clear(storage)
    files = tempfile.mkdtemp(prefix="raytf-trial-ckpt-")
    try:
        for name in os.listdir(folder):
            if name not in (ORIGIN, META):
                shutil.copy2(os.path.join(folder, name), files)
        storage.upload(files, meta)  # raytf.json written last: the checkpoint is complete only then
    finally:
        shutil.rmtree(files, ignore_errors=True)
    there = [c.step for c in storage.list()]
    if there != [meta["step"]]:  # e.g. a worker of the trial's last start still saving
        raise RuntimeError(f"checkpoint.dir {storage.location} holds steps {there} after the hand-back of step "
                           f"{meta['step']}; the trial would not resume from it")
    return origin
