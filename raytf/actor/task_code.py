"""The job's code in a task process: its environment variables set, and its folders unpacked on this node from
the driver's zips (raytf.protocol.TaskCode, packed by raytf.driver.packaging.pack_code).

Each package unpacks once per node, into a folder named by its content hash in Ray's session folder, and a
folder there is never replaced: a task finding it made uses it, and two tasks unpacking at once each unzip
into a folder of their own and the first rename wins. (Ray's own working_dir unpacking replaced the folder on
a node meeting the package for the first time, under the feet of another node's tasks where nodes share a
disk.) Like Ray's runtime-env folders, they stay with the session's other files when the tasks end.
"""
from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import zipfile

import ray

from raytf.protocol import CodePackage, TaskCode


def install(code: TaskCode) -> str:
    """Set the job's variables in this process (before TensorFlow is imported), unpack its folders, put its
    modules' folders on sys.path, and return the job folder's path on this node."""
    os.environ.update(dict(code.env_vars))
    base = os.path.join(_session_dir(), "raytf_code")
    for package in reversed(code.modules):
        folder = unpacked(base, package)
        if folder not in sys.path:
            sys.path.insert(0, folder)
    return unpacked(base, code.working_dir)


def unpacked(base: str, package: CodePackage) -> str:
    """`package`'s folder under `base`, unpacked now if no task of this node did before."""
    target = os.path.join(base, package.name)
    if os.path.isdir(target):
        return target
    os.makedirs(base, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{package.name}.", dir=base)
    try:
        data = package.data if isinstance(package.data, bytes) else ray.get(package.data)  # bytes: a test's
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            archive.extractall(partial)
            for info in archive.infolist():  # zipfile restores no permissions (a script's executable bit)
                mode = info.external_attr >> 16 & 0o777
                if mode and not info.is_dir():
                    os.chmod(os.path.join(partial, info.filename), mode)
        os.rename(partial, target)
    except OSError:
        if not os.path.isdir(target):  # not another task's rename that came first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _session_dir() -> str:
    try:  # Ray-private; raytf pins Ray 2.60.*
        return ray._private.worker.global_worker.node.get_session_dir_path()
    except AttributeError:  # not in a Ray worker (a test calling install directly)
        return tempfile.gettempdir()
