"""A task's scratch folder on its node's local disk, and the sweep of those that dead tasks left behind.

Each task writes into one folder of the node's temp dir: what is shipped back to output.dir (`staging`),
its data.cache: disk files, and temporary files (raytf's checkpoint copies, TensorFlow's AutoGraph
sources). A task that ends well removes its folder. One ended by the driver's `ray.kill` (a restart, a stop,
a trial cut short) or by a crash cleans nothing, so the folder's name carries its process id, and a sweep
removes the folders whose process is gone: each new task sweeps its node, and the driver of an embedded
local Ray sweeps after shutting it down.

Only this module knows the naming; it imports neither Ray nor TensorFlow.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time

PREFIX = "raytf-task-"
_OWNED = re.compile(re.escape(PREFIX) + r"(\d+)-")  # raytf-task-<pid>-<random>


def create(root: str | None = None) -> str:
    """A new scratch folder owned by this process, under `root` (default: the temp dir)."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)


def owner(name: str) -> int | None:
    """The process id a scratch folder's name carries; None for any other name."""
    match = _OWNED.match(name)
    return int(match.group(1)) if match else None


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (one that has exited, not yet reaped, uses no files)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the (command name)
    except (OSError, IndexError):  # no /proc (not Linux): existing is alive
        return True


def sweep(root: str, grace_s: float = 0.0, since: float | None = None) -> list[str]:
    """Remove the scratch folders in `root` whose process is gone; returns their paths. With `grace_s`,
    folders made since `since` (by processes being shut down now) get that long for their process to exit.
    Folders of other live processes (another job's tasks on this node) are left alone."""
    deadline = time.time() + grace_s
    removed = []
    while True:
        waiting = False
        try:
            entries = list(os.scandir(root))
        except OSError:
            return removed
        for entry in entries:
            pid = owner(entry.name)
            if pid is None or pid == os.getpid():
                continue
            if alive(pid):
                waiting |= since is not None and _mtime(entry) >= since
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        if not waiting or time.time() >= deadline:
            return removed
        time.sleep(0.2)


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0
