"""A task's scratch folder on its node's local disk, and the sweep of those that dead tasks left behind.

Each task writes into one folder of the node's temp dir: what is shipped back to output.dir (`staging`),
its data.cache: disk files, and temporary files (raytf's checkpoint copies, TensorFlow's AutoGraph
sources). A task that ends well removes its folder. One ended by the driver's `ray.kill` (a restart, a stop,
a trial cut short) or by a crash cleans nothing, so the sweep removes the folders whose task is gone: each
task sweeps its node when it starts and when it ends, and the driver of an embedded local Ray after
shutting it down.

Whether a task is gone is asked of its lock, not of its process id: the task holds an exclusive lock on
the folder's `.owner` file for its whole life, and the kernel drops it however the process ends. A process
id would mislead where process ids are not the node's own (containers sharing a temp dir, a temp dir on a
shared file system) or are reused. Only this module knows the layout; it imports neither Ray nor TensorFlow.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

PREFIX = "raytf-task-"
OWNER = ".owner"


class Scratch:
    """A new folder under `root` (default: the temp dir), held by this process until `remove` or its end."""

    def __init__(self, root: str | None = None):
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)  # the pid is for people only
        # Locked under another name first: a sweep must never find the owner file unlocked while we live.
        self._lock = open(os.path.join(self.path, OWNER + ".new"), "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(self._lock.name, os.path.join(self.path, OWNER))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.close()


def sweep(root: str, grace_s: float = 0.0, since: float | None = None) -> list[str]:
    """Remove the scratch folders in `root` whose task is gone; returns their paths. With `grace_s`,
    folders made since `since` (by tasks being shut down now) get that long for their process to exit.
    The folders of live tasks (another job's, on this node) are left alone. Never raises."""
    deadline = time.time() + grace_s
    removed = []
    while True:
        waiting = False
        try:
            entries = [e for e in os.scandir(root) if e.name.startswith(PREFIX)]
        except OSError:
            return removed
        for entry in entries:
            gone = _take_if_gone(entry.path)
            if gone is None:  # not a scratch folder of this kind (no owner file): left alone
                continue
            if gone is False:
                waiting |= since is not None and _mtime(entry) >= since
                continue
            with gone:  # held while removing, so no other sweep takes it meanwhile
                shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        if not waiting or time.time() >= deadline:
            return removed
        time.sleep(0.2)


def _take_if_gone(folder: str):
    """The folder's owner file, locked by us, when its task is gone; False when a task holds it; None when
    the folder has none (not ours, already removed, or just being made: the lock follows the folder)."""
    try:
        owner = open(os.path.join(folder, OWNER), "r")
    except OSError:
        return None
    try:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: the task lives
        owner.close()
        return False
    return owner


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0
