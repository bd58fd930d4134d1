"""A folder anywhere pyarrow.fs reaches: a local path, or a URI (s3://, gs://, hdfs://, ...).

A run's output.dir is one (`Folder("s3://bucket/runs/m", "output.dir")`): the driver reads an earlier
attempt's result.json from it, writes its state into it, and ships what it staged locally (model,
SavedModel, TensorBoard events, result.json) up into it. No Ray, no TensorFlow.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
import stat
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

from raytf.errors import RaytfError, SpecError

CHUNK = 8 << 20
# Every call to a store has this deadline: a silent endpoint is an error after it, never a hang. The variable is
# read once, here, for every raytf process (the driver, a sweep's trials, `raytf results`).
TIMEOUT_S = float(os.environ.get("RAYTF_STORAGE_TIMEOUT_S") or 30.0)
STAGING_PREFIX = "raytf-staging-"
STAGING_MARK = ".raytf-staging"  # in a staging folder: the token its run's lease records (raytf.driver.lease)
T = TypeVar("T")


class StorageTimeout(RaytfError):
    """A store that did not answer in time (exit 1: the environment, not the spec)."""


class StorageError(RaytfError):
    """A store's own error (unreachable, refused, throttled) in one line naming the folder, the endpoint and what
    raytf was doing (exit 1); `cause` is pyarrow's error."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


# Credentials in a URI: "user:secret@" (a secret may hold "/", as AWS secret keys do), or a bare key before the
# bucket of an object store ("s3://KEY@bucket"; hdfs://user@namenode names a user, not a secret).
_SECRET = re.compile(r"^([a-z][a-z0-9+.-]*://)[^@/?#]*:[^@]*@", re.IGNORECASE)
_BARE_KEY = re.compile(r"^((?:s3|s3a|gs|gcs|abfs|abfss|az)://)[^/@]*@", re.IGNORECASE)


def uri_problem(where: str) -> str | None:
    """What is wrong with a storage URI before anything opens it (pure), or None: a URI with no bucket or
    host (`s3://` alone), or credentials inside it (every log, result.json and manifest would repeat them).
    The text never repeats the credentials."""
    match = re.match(r"^([a-z][a-z0-9+.-]*)://([^/]*)", where, re.IGNORECASE)
    if match is None:
        return None
    scheme, authority = match.group(1).lower(), match.group(2)
    if _SECRET.match(where) or _BARE_KEY.match(where):
        return (f"carries credentials before '@', which logs, result.json and manifests would repeat; give "
                f"{scheme}://<bucket>/<path> and the credentials in the environment (AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://)")
    if scheme != "file" and not authority:
        return f"names no bucket or host; give {scheme}://<bucket>/<path>"
    return None


def shown(where: str) -> str:
    """A URI fit for a message: credentials before '@' masked."""
    where = str(where)
    for pattern in (_SECRET, _BARE_KEY):
        where = pattern.sub(r"\1***@", where)
    return where


def endpoint_of(where: str) -> str:
    """The server a URI talks to, for messages: the S3 endpoint from the environment, else scheme://bucket."""
    if where.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return endpoint
    match = re.match(r"^([a-z][a-z0-9+.-]*://[^/]*)", where, re.IGNORECASE)
    return shown(match.group(1)) if match else where


_abandoned = threading.Event()


def calls_abandoned() -> bool:
    """Whether a store call was left running (a deadline passed, a signal came). pyarrow's S3 client then
    waits for it at interpreter exit, without end: the CLI leaves with os._exit instead."""
    return _abandoned.is_set()


def within(timeout_s: float, what: str, call: Callable[[], T]) -> T:
    """`call()` with a deadline. It runs in a thread of its own, so this thread waits in an interruptible
    wait: Ctrl-C and SIGTERM are taken at once, and a store that never answers is a StorageTimeout naming
    `what`. (A call abandoned on a deadline or a signal finishes, or not, in its thread: nothing waits for it.)"""
    done, box = threading.Event(), {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="raytf-storage-call", daemon=True).start()
    try:
        answered = done.wait(timeout_s)
    except BaseException:  # Ctrl-C, SIGTERM: the call is left behind
        _abandoned.set()
        raise
    if not answered:
        _abandoned.set()
        raise StorageTimeout(f"{what} did not answer within {timeout_s:g} s; check that the endpoint is up and "
                             f"reachable from this machine")
    if "error" in box:
        raise box["error"]
    return box["value"]


def is_uri(where: str | os.PathLike) -> bool:
    return "://" in str(where)


def open_fs(where: str):
    """(filesystem, root path) for a local path or URI; ValueError/OSError from pyarrow as they come."""
    import pyarrow.fs as pafs

    if is_uri(where):
        return pafs.FileSystem.from_uri(where)
    return pafs.LocalFileSystem(), os.path.abspath(where)


def probe_write(fs, root: str) -> None:
    """Create `root` and write and delete a probe file in it: what "writable" means for every folder raytf
    writes (output.dir, checkpoint.dir). The file system's own error, if any, is for the caller to word."""
    probe = posixpath.join(root, f".raytf-probe-{uuid.uuid4().hex}")
    fs.create_dir(root, recursive=True)
    with fs.open_output_stream(probe) as f:
        f.write(b"ok")
    fs.delete_file(probe)


def new_staging(name: str) -> tuple[Path, str]:
    """A fresh staging folder for a run whose output.dir is a URI, and its token: made by mkdtemp in this
    machine's temp dir (mode 0700, a name nobody can guess, so nobody can prepare it or plant a link there),
    outside every job folder. The token, in the folder and in the run's lease, lets a later run on this
    machine recognise it as a leftover of that run (`own_staging`)."""
    path = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name[:40]}-"))
    token = uuid.uuid4().hex
    (path / STAGING_MARK).write_text(token)
    return path, token


def own_staging(path: str | None, token: str | None) -> Path | None:
    """`path` if it is a staging folder this user made for the lease holding `token`, or None: directly in
    this machine's temp dir, named by new_staging, a real folder (not a link) owned by this user and private,
    with the token inside. A record in a bucket can name any path: anything else is never read nor deleted."""
    if not path or not token:
        return None
    folder = Path(path)
    if str(folder.parent) != tempfile.gettempdir() or not folder.name.startswith(STAGING_PREFIX):
        return None
    try:
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            return None
        fd = os.open(folder / STAGING_MARK, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            return folder if f.read(100).strip() == token else None
    except OSError:
        return None


class Folder:
    """One folder of a file system; `what` names it in messages (e.g. "output.dir"). Every call to a remote
    store has a deadline (`timeout_s`): a silent endpoint is a StorageTimeout naming it, never a hang."""

    def __init__(self, where: str, what: str = "output.dir", timeout_s: float = TIMEOUT_S):
        self.where, self.what, self.timeout_s = str(where).rstrip("/") or str(where), what, timeout_s
        problem = uri_problem(str(where))
        if problem:
            raise SpecError(f"{what} {shown(str(where))} {problem}")
        try:
            self.fs, self.root = self._call(lambda: open_fs(self.where), "opening it")
        except StorageTimeout:
            raise
        except Exception as exc:  # an unknown scheme, a malformed URI, a missing library, a bucket not found
            exc = exc.cause if isinstance(exc, StorageError) else exc
            raise SpecError(f"{what} {shown(self.where)}: pyarrow cannot open it ({first_line(exc)}); give a local path "
                            f"or a URI pyarrow.fs knows (s3://bucket/path, gs://bucket/path, hdfs://host/path)") from None

    def _call(self, call: Callable[[], T], doing: str = "") -> T:
        """A call to the file system, under the deadline when it is a remote store (a local disk is called
        directly: its errors are immediate)."""
        if not is_uri(self.where):
            return call()
        what = f"{self.what} {shown(self.where)} ({endpoint_of(self.where)}{', ' if doing else ''}{doing})"
        try:
            return within(self.timeout_s, what, call)
        except OSError as exc:  # pyarrow's: one line, not a traceback from deep inside it
            raise StorageError(f"{what}: {first_line(exc)}; check the endpoint, the credentials and that the "
                               f"bucket exists", exc) from None

    @property
    def remote(self) -> bool:
        return is_uri(self.where)

    def location(self, rel: str = "") -> str:
        """A path inside this folder, in the form the user gave (a URI stays a URI)."""
        return f"{self.where}/{rel}" if rel else self.where

    def _path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def check_writable(self) -> None:
        """Create the folder, write and delete a probe: a SpecError naming the folder and the fix if not."""
        self._check_endpoint()
        try:
            self._call(lambda: probe_write(self.fs, self.root), "writing a probe")
        except StorageTimeout:
            raise
        except Exception as exc:
            hint = ("check the endpoint (AWS_ENDPOINT_URL), the credentials and that the bucket exists and is "
                    "writable" if self.remote else "give a folder you can write")
            raise SpecError(f"{self.what} {self.where} cannot be written ({first_line(exc)}); {hint}") from None

    def _check_endpoint(self, timeout_s: float = 5.0) -> None:
        """An s3:// folder behind an endpoint that does not answer: said at once (the S3 client retries for
        seconds before it gives up), naming the endpoint and where it was set."""
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if not self.where.startswith("s3://") or not endpoint:
            return
        import socket
        import urllib.parse

        url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
        except OSError as exc:
            raise SpecError(f"{self.what} {self.where}: the S3 endpoint {endpoint} (AWS_ENDPOINT_URL) does not answer "
                            f"({exc.strerror or exc}); start it, or fix AWS_ENDPOINT_URL") from None

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's content; None when there is no such file."""
        import pyarrow.fs as pafs

        path = self._path(rel)

        def read() -> bytes | None:
            if self.fs.get_file_info(path).type != pafs.FileType.File:
                return None
            with self.fs.open_input_stream(path) as f:
                return f.read()
        return self._call(read, f"reading {rel}")

    def read_json(self, rel: str) -> Any:
        """A JSON file's value; None when it is missing or not JSON (a half-written file from a crash)."""
        data = self.read_bytes(rel)
        try:
            return None if data is None else json.loads(data)
        except ValueError:
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole file. Locally via a temporary file and a rename (readers never see half of it); an
        object store shows an object only once it is complete."""
        path = self._path(rel)
        if self.remote:
            def put() -> None:
                self.fs.create_dir(posixpath.dirname(path), recursive=True)
                with self.fs.open_output_stream(path) as f:
                    f.write(data)
            self._call(put, f"writing {rel}")
            return
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def write_json(self, rel: str, value: Any) -> None:
        self.write_bytes(rel, (json.dumps(value, indent=2, default=str, allow_nan=False) + "\n").encode())

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self._call(lambda: self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound,
                          f"looking for {rel}")

    def files(self, rel: str = "") -> list[str]:
        """Every file under `rel`, as paths relative to this folder, sorted."""
        import pyarrow.fs as pafs

        base = self._path(rel)
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        found = self._call(lambda: self.fs.get_file_info(selector), f"listing {rel or 'it'}")
        return sorted(posixpath.relpath(e.path, self.root) for e in found if e.type == pafs.FileType.File)

    def upload(self, local_dir: Path, skip: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> list[str]:
        """Copy every file under local_dir into this folder at the same relative paths (names in `skip`, at
        any depth, stay behind; those in `last`, at the top, go after all others: a reader who sees a new
        result.json finds everything it names). Every open and chunk is under the deadline, so a stalled
        store fails the upload rather than hanging it. Returns the relative paths copied."""
        found = []
        for dirpath, dirnames, filenames in os.walk(local_dir):
            dirnames[:] = sorted(d for d in dirnames if d not in skip)
            found += [(Path(dirpath) / name).relative_to(local_dir).as_posix()
                      for name in sorted(filenames) if name not in skip]
        ordered = [rel for rel in found if rel not in last] + [rel for rel in found if rel in last]
        for rel in ordered:
            self._upload_file(local_dir / rel, rel)
        return ordered

    def _upload_file(self, src: Path, rel: str) -> None:
        target = self._path(rel)
        doing = f"uploading {rel}"

        def open_target():
            self.fs.create_dir(posixpath.dirname(target), recursive=True)
            return self.fs.open_output_stream(target)
        out = self._call(open_target, doing)
        try:
            with open(src, "rb") as f:
                while chunk := f.read(CHUNK):
                    self._call(lambda: out.write(chunk), doing)
            self._call(out.close, doing)  # the object appears only now, whole
        except BaseException:
            # Never closed: closing would publish the part written so far as the whole object.
            _ABANDONED.append(out)
            raise

    def move(self, rel: str, to_rel: str) -> None:
        """Move a file or a whole folder (object stores move files only: a folder is copied file by file,
        then deleted)."""
        import pyarrow.fs as pafs

        source, target = self._path(rel), self._path(to_rel)
        info = self._call(lambda: self.fs.get_file_info(source), f"looking for {rel}")
        if info.type == pafs.FileType.NotFound:
            return
        if info.type == pafs.FileType.File or not self.remote:
            def move_one() -> None:
                self.fs.create_dir(posixpath.dirname(target), recursive=True)
                self.fs.move(source, target)
            self._call(move_one, f"moving {rel}")
            return
        for inner in self.files(rel):
            def copy_one(inner=inner) -> None:
                self.fs.create_dir(posixpath.dirname(self._path(to_rel + inner[len(rel):])), recursive=True)
                self.fs.copy_file(self._path(inner), self._path(to_rel + inner[len(rel):]))
            self._call(copy_one, f"moving {inner}")
        self._call(lambda: self.fs.delete_dir(source), f"moving {rel}")


_ABANDONED: list = []  # streams of abandoned uploads, kept referenced so that no destructor completes them


def first_line(exc: BaseException) -> str:
    """An error's first line (at most 300 characters), for a one-line message."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
