"""Which Ray to use: the one already initialised in this process, an existing cluster (--address, or
RAY_ADDRESS as set by `ray job submit`), or an embedded local Ray started for this run and shut down after."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import ray


@contextlib.contextmanager
def ray_session(address: str | None = None) -> Iterator[None]:
    if ray.is_initialized():
        yield
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=True)
    else:
        # "local": a fresh Ray of our own. A bare ray.init() would join whatever cluster was started last
        # on this machine (/tmp/ray/ray_current_cluster) -- someone else's, or a test's.
        ray.init(address="local", include_dashboard=False, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()
