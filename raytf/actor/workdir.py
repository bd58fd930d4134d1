"""A task's own working folder: the job folder's entries, linked, in a folder of the task's own.

A job's folder is unpacked once per node (raytf.actor.task_code) and every task of the job starts in it, so two
tasks on one node writing the same relative path (TensorFlow's custom-training tutorial saves
`./training_checkpoints/ckpt` on every worker) collide. Each task runs in a folder of its own instead, inside
its scratch folder (removed when the task ends): the job's files and folders appear there as links, so reading
them works as before, and a new relative file or folder is this task's alone. Pure file-system work: no Ray,
no TensorFlow.
"""
from __future__ import annotations

import os
import sys


def enter(job_root: str, folder: str) -> str:
    """Make `folder` (new) hold a link to each entry of `job_root`, keep the job's modules importable, and
    make `folder` the working directory. Returns `folder`."""
    os.mkdir(folder)
    for entry in os.scandir(job_root):
        os.symlink(entry.path, os.path.join(folder, entry.name), target_is_directory=entry.is_dir())
    if job_root not in sys.path:  # modules were found through the working directory ('' on sys.path) so far
        sys.path.insert(0, job_root)
    os.chdir(folder)
    return folder


def written(folder: str, prefix: str) -> dict[str, bytes]:
    """What the task wrote into its working folder (`folder`, made by `enter`): every file under an entry
    that is not one of the job folder's links, keyed `<prefix>/<path relative to folder>`."""
    out = {}
    for entry in os.scandir(folder):
        if entry.is_symlink() or entry.name == "__pycache__":  # the job folder's own entry; Python's bytecode
            continue
        paths = [entry.path] if entry.is_file() else [os.path.join(root, name) for root, _, names in
                                                       os.walk(entry.path) for name in names
                                                       if "__pycache__" not in root]
        for path in paths:
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                out[f"{prefix}/{os.path.relpath(path, folder)}"] = f.read()
    return out
