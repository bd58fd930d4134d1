"""The job folder as a package for the cluster: what goes into it, how large it may be, and its upload.

Ray builds a package's zip in a scratch folder, by default the current directory. A run started inside
the job folder then zipped the folder into itself, zip included, until the disk was full. raytf gives
Ray a private temporary folder instead and removes it afterwards, whatever happens (Ctrl-C included).
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from raytf.errors import SpecError
from raytf.spec import FUNCTION_KEYS, Job, function_ref, modules_outside

MAX_PACKAGE_BYTES = 100 * 1024 ** 2  # a job folder larger than this belongs in storage every node reads
ALWAYS_EXCLUDED = [".git", "__pycache__"]

# Ray logs each package it creates and pushes at INFO ("Creating a file package ...", "Pushing file
# package ..."); raytf says what it uploads itself, so Ray's lines show with --verbose only.
_quiet_logger = logging.getLogger("raytf.driver.packaging.ray")
_quiet_logger.setLevel(logging.WARNING)


def excludes_for(job: Job) -> list[str]:
    """What never travels: version-control and bytecode folders, and output.dir (results stay behind)."""
    excludes = list(ALWAYS_EXCLUDED)
    try:
        inside = job.output_dir.relative_to(job.job_dir)
    except ValueError:  # output.dir is outside the job folder
        return excludes
    if inside.parts:
        excludes.append("/" + inside.as_posix())
    return excludes


def runtime_env(job: Job) -> dict[str, Any]:
    """The job folder travels to every actor as its working directory; modules found only in the
    driver's working directory travel as py_modules. Outputs stay behind."""
    extra_modules = modules_outside(job.job_dir, [function_ref(job.spec, key) for key in FUNCTION_KEYS])
    env_vars = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    if job.spec.train.keras == "legacy":  # tf.keras is tf-keras (Keras 2) in every actor
        env_vars["TF_USE_LEGACY_KERAS"] = "1"
    env = {"working_dir": str(job.job_dir), "excludes": excludes_for(job), "env_vars": env_vars}
    if extra_modules:
        env["py_modules"] = extra_modules
    return env


def _include_gitignore() -> bool:
    return os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"


def package_files(folder: Path, excludes: list[str]) -> list[tuple[str, int]]:
    """(relative path, bytes) of every file Ray would pack from `folder`, found with Ray's own rules
    (its default excludes, `excludes`, and the .gitignore/.rayignore files inside the folder)."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    folder = Path(folder).absolute()
    found: list[tuple[str, int]] = []

    def record(path: Path) -> None:
        if path.is_file() and not path.is_symlink():
            found.append((str(path.relative_to(folder)), path.stat().st_size))

    rules = ray_constants.get_runtime_env_default_excludes() + list(excludes)
    _dir_travel(folder, [_get_excludes(folder, rules)], record, include_gitignore=_include_gitignore())
    return found


def check_size(folder: Path, excludes: list[str], limit: int = MAX_PACKAGE_BYTES) -> int:
    """The package's size in bytes; a folder over `limit` is a SpecError naming its largest files."""
    if not Path(folder).is_dir():
        return Path(folder).stat().st_size if Path(folder).exists() else 0
    files = package_files(folder, excludes)
    total = sum(size for _, size in files)
    if total > limit:
        largest = sorted(files, key=lambda f: -f[1])[:5]
        shown = ", ".join(f"{path} ({_mib(size)})" for path, size in largest)
        raise SpecError(
            f"the job folder {folder} would upload {_mib(total)} to every node, more than the {_mib(limit)} "
            f"raytf allows; the largest files: {shown}. Leave them out with a .rayignore (or .gitignore) in "
            f"the job folder, or move the data to storage every node reads (a shared path, s3://, gs://) "
            f"and point data.train at it")
    return total


def check_job_folder(job: Job) -> None:
    """Before anything starts: the job folder (and any module that travels beside it) is small enough."""
    check_size(job.job_dir, excludes_for(job))
    for module in modules_outside(job.job_dir, [function_ref(job.spec, key) for key in FUNCTION_KEYS]):
        check_size(Path(module), list(ALWAYS_EXCLUDED))


def upload_code(env: dict[str, Any], verbose: bool = False) -> dict[str, Any]:
    """Upload local working_dir/py_modules to the cluster and put their URIs in their place.

    Ray accepts local paths only in ray.init's job-level runtime_env; raytf sets the env per actor
    (it may run in a process whose Ray someone else initialised: a notebook, a Tune trial), so it
    uploads the way ray.init does. These helpers are Ray-private; raytf pins Ray 2.60.*."""
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    if "working_dir" in env and not _is_uri(env["working_dir"]):
        check_size(Path(env["working_dir"]), env.get("excludes", []))
    for module in env.get("py_modules", []):
        if not _is_uri(module):
            check_size(Path(module), list(ALWAYS_EXCLUDED))
    logger = logging.getLogger("ray") if verbose else _quiet_logger
    with tempfile.TemporaryDirectory(prefix="raytf-pkg-") as scratch:  # never the folder being packed
        env = upload_py_modules_if_needed(dict(env), include_gitignore=_include_gitignore(),
                                          scratch_dir=scratch, logger=logger)
        return upload_working_dir_if_needed(env, include_gitignore=_include_gitignore(),
                                            scratch_dir=scratch, logger=logger)


def _is_uri(value: Any) -> bool:
    return isinstance(value, str) and "://" in value


def _mib(size: int) -> str:
    return f"{size / 1024 ** 2:.1f} MiB"
