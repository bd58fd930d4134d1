"""The job folder as a package for the cluster: what goes into it, how large it may be, and its packing.

Ray builds a package's zip in a scratch folder, by default the current directory. A run started inside
the job folder then zipped the folder into itself, zip included, until the disk was full. raytf gives
Ray a private temporary folder instead and removes it afterwards, whatever happens (Ctrl-C included).

Results never travel: this job's output.dir, the default output root `runs/`, and every folder under the
job folder that holds an earlier run's or sweep's outputs (raytf marks each output.dir it writes with
OUTPUT_MARKER; older ones are known by their result.json or sweep.json) are left out.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from raytf import tracking
from raytf.errors import SpecError
from raytf.job import Job
from raytf.job_code import modules_outside
from raytf.protocol import CodePackage, TaskCode
from raytf.spec import FUNCTION_KEYS, function_ref

MAX_PACKAGE_BYTES = 100 * 1024 ** 2  # a job folder larger than this belongs in storage every node reads
ALWAYS_EXCLUDED = [".git", "__pycache__"]
# Credentials never leave this machine with a job folder: files and folders that commonly hold them, as
# gitignore-style patterns matched at any depth (keys, cloud and cluster credentials, dotenv files).
SECRETS = [".env", ".env.*", "*.env", ".ssh", ".aws", ".gcloud", ".azure", ".ray", ".kube", ".docker", ".gnupg",
           ".netrc", ".git-credentials", ".pypirc", ".npmrc", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*",
           "id_dsa*", "id_ecdsa*", "id_ed25519*", "credentials", "credentials.json", "*service-account*.json"]
OUTPUT_MARKER = ".raytf-output"  # in every output.dir raytf writes: later packaging leaves the folder out
DEFAULT_OUTPUT_ROOT = "runs"  # output.dir's default is runs/<name> in the job folder
_RESULT_KEYS = {"name", "strategy", "status", "output_dir", "history", "tasks"}  # raytf's result.json
_SWEEP_KEYS = {"name", "metric", "mode", "output_dir", "rows", "best"}  # raytf's sweep.json
_LARGEST_JSON = 64 * 1024 ** 2

# Ray's packaging functions log through the logger they are given ("Creating a file package ...", "File
# ... is very large ...") and through their modules' own loggers. Without --verbose none of it reaches the
# terminal in Ray's words: it is collected here, and raytf says what matters itself.
_RAY_PACKAGING_LOGGERS = ("ray._private.runtime_env", "ray.dashboard.modules.dashboard_sdk")
_collecting_logger = logging.getLogger("raytf.driver.packaging.ray")
_collecting_logger.propagate = False
_VERY_LARGE = re.compile(r"^File (?P<path>.+) is very large \((?P<size>[^)]*)\)")


def mark_output(folder: Path) -> None:
    """Make `folder` (an output.dir) if needed and mark it as raytf's, so that a later job in the same job
    folder leaves it out of its package, whatever its name."""
    folder = Path(folder)
    marker = folder / OUTPUT_MARKER
    if marker.exists():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text("raytf wrote this folder (a run's output.dir); raytf never uploads it with the job folder.\n")
    except OSError:  # a read-only or remote mount: result.json still marks it
        pass


def _holds_json(path: Path, keys: set[str]) -> bool:
    try:
        if not path.is_file() or path.stat().st_size > _LARGEST_JSON:
            return False
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and keys <= data.keys()


def is_output_dir(folder: Path) -> bool:
    """Whether `folder` holds a raytf run's or sweep's outputs: its marker, or raytf's result.json/sweep.json."""
    folder = Path(folder)
    return ((folder / OUTPUT_MARKER).is_file() or _holds_json(folder / "result.json", _RESULT_KEYS)
            or _holds_json(folder / "sweep.json", _SWEEP_KEYS))


def earlier_outputs(job_dir: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """The folders under `job_dir` (relative, POSIX) that hold a run's or sweep's outputs, outermost only.
    The job folder itself never counts; `skip` names folders not to look into (already left out)."""
    job_dir = Path(job_dir)
    found: list[str] = []
    pruned = set(ALWAYS_EXCLUDED) | set(_ray_default_excludes())
    for root, dirs, _ in os.walk(job_dir):
        here = Path(root)
        keep = []
        for name in sorted(dirs):
            folder = here / name
            rel = folder.relative_to(job_dir).as_posix()
            if name in pruned or rel in skip:
                continue
            if is_output_dir(folder):
                found.append(rel)
            else:
                keep.append(name)
        dirs[:] = keep
    return found


def _ray_default_excludes() -> list[str]:
    """The folder names Ray never packs (.venv, node_modules, ...): not worth looking into."""
    try:
        from ray._private import ray_constants

        return [x.strip("/") for x in ray_constants.get_runtime_env_default_excludes() if "*" not in x]
    except (ImportError, AttributeError):
        return []


def _pattern(rel: str) -> str:
    """A folder relative to the job folder as an anchored gitignore pattern (wildcards escaped)."""
    return "/" + re.sub(r"([\\*?\[\]!#])", r"\\\1", rel)


def excludes_for(job: Job) -> list[str]:
    """What never travels: version-control and bytecode folders, and results: this job's output.dir, the
    default output root runs/, and every earlier run's or sweep's output.dir under the job folder."""
    excludes = list(ALWAYS_EXCLUDED) + SECRETS + ["/" + DEFAULT_OUTPUT_ROOT]
    skip = [DEFAULT_OUTPUT_ROOT]
    try:
        inside = None if "://" in job.output_where else Path(job.output_where).relative_to(job.job_dir)
    except ValueError:  # output.dir is outside the job folder
        inside = None
    if inside is not None and inside.parts:
        excludes.append(_pattern(inside.as_posix()))
        skip.append(inside.as_posix())
    if job.checkpoint_dir is not None and "://" not in job.checkpoint_dir:  # checkpoints never travel either
        try:
            excludes.append(_pattern(Path(job.checkpoint_dir).resolve().relative_to(Path(job.job_dir).resolve())
                                     .as_posix()))
        except ValueError:  # outside the job folder
            pass
    for path in tracking.local_store(job):  # an MLflow SQLite store in the job folder stays behind too
        try:
            excludes.append(_pattern(path.resolve().relative_to(Path(job.job_dir).resolve()).as_posix()))
        except ValueError:
            pass
    excludes += [_pattern(rel) for rel in earlier_outputs(job.job_dir, tuple(skip))]
    return excludes


def runtime_env(job: Job) -> dict[str, Any]:
    """The job folder travels to every actor as its working directory; modules found only in the
    driver's working directory travel as py_modules. Outputs stay behind."""
    extra_modules = modules_outside(job.job_dir, [function_ref(job.spec, key) for key in FUNCTION_KEYS])
    env_vars = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    # tf.keras is tf-keras (Keras 2) in every actor under legacy, else Keras 3 as the spec says, also where the
    # cluster's (or an embedded Ray's, the driver's) environment says otherwise
    env_vars["TF_USE_LEGACY_KERAS"] = "1" if job.spec.train.keras == "legacy" else "0"
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


def check_job_folder(job: Job) -> str | None:
    """Before anything starts: the job folder is a folder of its own (not the home folder or /, which would
    travel whole) and small enough, as is any module that travels beside it. Returns a line for the user
    naming the credential files left out of the package, if there are any."""
    folder = Path(job.job_dir).resolve()
    if folder == Path.home().resolve() or folder == Path(folder.anchor):
        what = "the root folder" if folder == Path(folder.anchor) else "your home folder"
        raise SpecError(f"the job folder is {folder} ({what}): raytf uploads the job folder to the cluster, and "
                        f"this one holds far more than the job; put the job file and its code in a folder of their own")
    check_size(job.job_dir, excludes_for(job))
    for module in modules_outside(job.job_dir, [function_ref(job.spec, key) for key in FUNCTION_KEYS]):
        check_size(Path(module), list(ALWAYS_EXCLUDED) + SECRETS)
    kept = secrets_in(folder)
    if not kept:
        return None
    shown = ", ".join(kept[:12]) + (" ..." if len(kept) > 12 else "")
    return f"raytf: left out of the job's package (credentials never leave this machine): {shown}"


def secrets_in(folder: Path, limit: int = 50) -> list[str]:
    """The files and folders under `folder` that SECRETS leaves out (relative; a folder with a trailing /),
    found with Ray's own matching, without looking into what is left out anyway."""
    from ray._private.runtime_env.packaging import _get_excludes

    folder = Path(folder)
    is_secret = _get_excludes(folder, SECRETS)
    pruned = set(ALWAYS_EXCLUDED) | set(_ray_default_excludes()) | {DEFAULT_OUTPUT_ROOT}
    found: list[str] = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        for name in sorted(files):
            if is_secret(here / name):
                found.append((here / name).relative_to(folder).as_posix())
        keep = []
        for name in sorted(dirs):
            if is_secret(here / name):
                found.append((here / name).relative_to(folder).as_posix() + "/")
            elif name not in pruned:
                keep.append(name)
        dirs[:] = keep
        if len(found) >= limit:
            break
    return found


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def ray_packaging_messages(verbose: bool = False,
                           note: Callable[[str], None] | None = None) -> Iterator[logging.Logger]:
    """While Ray packs and uploads: yields the logger to hand its functions. With `verbose`, Ray's own, and
    Ray's lines show as Ray writes them. Otherwise nothing Ray's packaging logs reaches the terminal: its
    lines are collected (the logger yielded, and its packaging modules' own loggers), and afterwards raytf
    names the very large files Ray would have warned about, in its own words, through `note`."""
    if verbose:
        yield logging.getLogger("ray")
        return
    handler = _Collect()
    loggers = [_collecting_logger] + [logging.getLogger(name) for name in _RAY_PACKAGING_LOGGERS]
    saved = [(each, each.propagate) for each in loggers]
    for each in loggers:
        each.addHandler(handler)
        each.propagate = False
    _collecting_logger.setLevel(logging.WARNING)
    try:
        yield _collecting_logger
    finally:
        for each, propagate in saved:
            each.removeHandler(handler)
            each.propagate = propagate
    large = [m.group("path", "size") for m in (_VERY_LARGE.match(r.getMessage()) for r in handler.records) if m]
    if large and note is not None:
        shown = ", ".join(f"{path} ({size})" for path, size in large[:5]) + (" ..." if len(large) > 5 else "")
        note(f"raytf: uploading large files to every node: {shown}; if the workers do not need them, leave them "
             f"out with a .rayignore in the job folder (or put data in storage every node reads)")


def pack_code(job: Job, verbose: bool = False, note: Callable[[str], None] | None = None,
              store: Callable[[bytes], Any] | None = None) -> TaskCode:
    """The job folder (and the modules found only in the driver's working directory) zipped once, as Ray would
    for a runtime env, into Ray's object store: each task process unpacks it itself (raytf.actor.task_code).

    Not a Ray runtime env: Ray starts every worker that has one through a second Python process
    (setup_worker.py, which imports Ray before the worker imports it again): ~0.4 CPU-s and ~0.7 s more per task
    process here (BENCHMARKS.md). The zip is the driver's object, alive while it runs: a replacement started
    late in a long run still finds it (a package uploaded to the cluster's store outlives no reference to it by
    more than 10 minutes). Ray's packaging functions are Ray-private; raytf pins Ray 2.60.*. Ray's lines about it
    show with `verbose` only; `note` gets raytf's own (ray_packaging_messages). `store`: ray.put, or a test's."""
    import ray
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import create_package, get_uri_for_directory, get_uri_for_file

    env = runtime_env(job)
    gitignore = _include_gitignore()

    def pack(path: str, excludes: list[str], parent: bool, scratch: str, logger: logging.Logger) -> CodePackage:
        is_dir = Path(path).is_dir()
        uri = get_uri_for_directory(path, include_gitignore=gitignore, excludes=excludes) if is_dir \
            else get_uri_for_file(path)
        name = uri.split("://", 1)[1].removesuffix(".zip")  # gcs://_ray_pkg_<content hash>.zip
        target = Path(scratch) / f"{name}.zip"
        create_package(path, target, include_gitignore=gitignore, include_parent_dir=parent and is_dir,
                       excludes=excludes, logger=logger)
        return CodePackage(name, (store or ray.put)(target.read_bytes()))

    check_size(Path(env["working_dir"]), env["excludes"])
    modules = env.get("py_modules", [])
    for module in modules:
        check_size(Path(module), list(ALWAYS_EXCLUDED))
    with ray_packaging_messages(verbose, note) as logger, \
            tempfile.TemporaryDirectory(prefix="raytf-pkg-") as scratch:  # never the folder being packed
        # as Ray's runtime env would: the default excludes for the working folder, the job's own for both
        working = pack(env["working_dir"], ray_constants.get_runtime_env_default_excludes() + env["excludes"],
                       False, scratch, logger)
        packed = tuple(pack(m, env["excludes"], True, scratch, logger) for m in modules)
    return TaskCode(working, packed, tuple(sorted(env["env_vars"].items())))


def _mib(size: int) -> str:
    return f"{size / 1024 ** 2:.1f} MiB"
