"""A folder anywhere pyarrow.fs reaches: a local path, or a URI (s3://, gs://, hdfs://, ...).

A run's output.dir is one (`Folder("s3://bucket/runs/m", "output.dir")`): the driver reads an earlier
attempt's result.json from it, writes its state into it, and ships what it staged locally (model,
SavedModel, TensorBoard events, result.json) up into it. No Ray, no TensorFlow.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile
import uuid
from pathlib import Path
from typing import Any

from raytf.errors import SpecError

CHUNK = 8 << 20


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


def staging_dir(uri: str, name: str) -> Path:
    """Where a run whose output.dir is a URI writes before shipping: a folder of this machine's temp dir,
    one per (run, URI), outside every job folder (so nothing lands in the job folder or a head's copy of it)."""
    digest = hashlib.sha1(uri.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "raytf-staging" / f"{name}-{digest}"


class Folder:
    """One folder of a file system; `what` names it in messages (e.g. "output.dir")."""

    def __init__(self, where: str, what: str = "output.dir"):
        self.where, self.what = str(where).rstrip("/") or str(where), what
        try:
            self.fs, self.root = open_fs(self.where)
        except Exception as exc:  # an unknown scheme, a malformed URI, a missing library
            raise SpecError(f"{what} {self.where}: pyarrow cannot open it ({_first_line(exc)}); give a local path "
                            f"or a URI pyarrow.fs knows (s3://bucket/path, gs://bucket/path, hdfs://host/path)") from None

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
            probe_write(self.fs, self.root)
        except Exception as exc:
            hint = ("check the endpoint (AWS_ENDPOINT_URL), the credentials and that the bucket exists and is "
                    "writable" if self.remote else "give a folder you can write")
            raise SpecError(f"{self.what} {self.where} cannot be written ({_first_line(exc)}); {hint}") from None

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
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(path) as f:
            return f.read()

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
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        if self.remote:
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def write_json(self, rel: str, value: Any) -> None:
        self.write_bytes(rel, (json.dumps(value, indent=2, default=str, allow_nan=False) + "\n").encode())

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound

    def files(self, rel: str = "") -> list[str]:
        """Every file under `rel`, as paths relative to this folder, sorted."""
        import pyarrow.fs as pafs

        base = self._path(rel)
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        found = [e.path for e in self.fs.get_file_info(selector) if e.type == pafs.FileType.File]
        return sorted(posixpath.relpath(p, self.root) for p in found)

    def upload(self, local_dir: Path, skip: tuple[str, ...] = ()) -> list[str]:
        """Copy every file under local_dir into this folder at the same relative paths (names in `skip`, at
        any depth, stay behind). Returns the relative paths copied."""
        copied = []
        for dirpath, dirnames, filenames in os.walk(local_dir):
            dirnames[:] = sorted(d for d in dirnames if d not in skip)
            for name in sorted(filenames):
                if name in skip:
                    continue
                src = Path(dirpath) / name
                rel = src.relative_to(local_dir).as_posix()
                target = self._path(rel)
                self.fs.create_dir(posixpath.dirname(target), recursive=True)
                with open(src, "rb") as f, self.fs.open_output_stream(target) as out:
                    while chunk := f.read(CHUNK):
                        out.write(chunk)
                copied.append(rel)
        return copied

    def move(self, rel: str, to_rel: str) -> None:
        """Move a file or a whole folder (object stores move files only: a folder is copied file by file,
        then deleted)."""
        import pyarrow.fs as pafs

        source, target = self._path(rel), self._path(to_rel)
        info = self.fs.get_file_info(source)
        if info.type == pafs.FileType.NotFound:
            return
        if info.type == pafs.FileType.File or not self.remote:
            self.fs.create_dir(posixpath.dirname(target), recursive=True)
            self.fs.move(source, target)
            return
        for inner in self.files(rel):
            self.fs.create_dir(posixpath.dirname(self._path(to_rel + inner[len(rel):])), recursive=True)
            self.fs.copy_file(self._path(inner), self._path(to_rel + inner[len(rel):]))
        self.fs.delete_dir(source)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
