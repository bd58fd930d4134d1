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
