"""A real S3 API on localhost for the tests: moto's server (moto[server], from the package registry) in a thread
of the test process, reached over HTTP by pyarrow's S3 client like any S3-compatible store.

Everything that talks to it finds it through the environment, as users configure theirs: AWS_ENDPOINT_URL
and credentials. `start()` sets them in os.environ, so Ray clusters and subprocesses started afterwards
inherit them."""
from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass
class S3:
    endpoint: str  # http://127.0.0.1:<port>
    env: dict  # the variables a client needs

    def fs(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=self.endpoint, access_key=self.env["AWS_ACCESS_KEY_ID"],
                                 secret_key=self.env["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                                 allow_bucket_creation=True)

    def bucket(self, prefix: str = "raytf") -> str:
        """A new empty bucket; returns its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.fs().create_dir(name)
        return name

    def files(self, uri: str) -> dict[str, int]:
        """Every object under the URI: path relative to it -> size."""
        import pyarrow.fs as pafs

        root = uri.split("://", 1)[1].rstrip("/")
        found = self.fs().get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        return {posixpath.relpath(e.path, root): e.size for e in found if e.type == pafs.FileType.File}

    def read(self, uri: str) -> bytes:
        with self.fs().open_input_stream(uri.split("://", 1)[1]) as f:
            return f.read()

    def download(self, uri: str, local: Path) -> Path:
        """Copy a file or a folder of objects to `local` (what a user does before loading a model)."""
        files = self.files(uri)
        if not files:  # a single object
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(self.read(uri))
            return local
        for rel in files:
            target = local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.read(f"{uri.rstrip('/')}/{rel}"))
        return local


_server = None
_s3: S3 | None = None


def start() -> S3:
    """The process's S3 server (started once), its variables set in os.environ."""
    global _server, _s3
    if _s3 is None:
        from moto.server import ThreadedMotoServer

        import logging

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        _server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        _server.start()
        host, port = _server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "raytf-test",
               "AWS_SECRET_ACCESS_KEY": "raytf-test", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        os.environ.update(env)
        _s3 = S3(endpoint=env["AWS_ENDPOINT_URL"], env=env)
    return _s3


class FaultProxy:
    """A TCP proxy in front of the S3 server that misbehaves on request: `hold` (accept, never answer), `drop`
    (close the connection) or `slow` (a delay per forwarded chunk), for every request or only for those whose
    request line (`PUT /bucket/key HTTP/1.1`) matches `match`. Clients reach it as their endpoint; `held` counts
    the requests it is holding. Stopped by `close()`; its threads are daemons."""

    def __init__(self, upstream: str):
        import socket
        import threading
        import urllib.parse

        url = urllib.parse.urlsplit(upstream)
        self.upstream = (url.hostname, url.port)
        self.mode, self.match, self.delay_s = "pass", None, 0.0
        self.held = 0
        self._sockets: list = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def fault(self, mode: str, match: str | None = None, delay_s: float = 0.0) -> "FaultProxy":
        self.mode, self.match, self.delay_s, self.held = mode, match, delay_s, 0
        return self

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source, target, requests: bool) -> None:
        import re
        import time

        try:
            while data := source.recv(65536):
                if requests and self.mode != "pass":
                    lines = re.findall(rb"^[A-Z]+ \S+ HTTP/1\.[01]", data, re.M)
                    hit = any(self.match is None or re.search(self.match, line.decode()) for line in lines)
                    if hit and self.mode == "hold":
                        self.held += 1
                        self._closed.wait()  # never answered
                        return
                    if hit and self.mode == "drop":
                        source.close()
                        target.close()
                        return
                    if self.mode == "slow":
                        time.sleep(self.delay_s)
                target.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        for s in [self._listener, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass


def proxy() -> FaultProxy:
    """A fault-injecting proxy in front of the process's S3 server (started if need be)."""
    return FaultProxy(start().endpoint)
