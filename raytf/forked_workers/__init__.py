"""Ray's Python workers forked from a process that has imported Ray's worker code and TensorFlow already.

A task process spends ~4.5 of its ~9 CPU-s importing TensorFlow, and Ray starts each worker through a second
interpreter that imports Ray only to exec the first (its setup_worker.py). Here the raylet's worker command is
`launcher.py` (RayParams.setup_worker_path): a bare interpreter that asks its node's zygote for the job
(`zygote.py`, started by the job's first launcher there) to fork the worker, and passes the raylet its exit. The
child runs Ray's default_worker.py as a started one would, with the launcher's environment, working directory and
output files.
Measured (a 2-worker digits job on a warm 3-node cluster): 2.8 s and 5.1 busy CPU-s against 7.7 s and 14.8.

Forking is safe here because the zygote starts no runtime: TensorFlow's import creates no device, no session
and no gRPC server (TF_CONFIG, devices and tf.keras's binding, lazy under TF_USE_LEGACY_KERAS, come later in the
child), Ray's worker connects to its raylet only in the child, and the zygote's only other threads at the fork,
numpy's OpenBLAS server and pyarrow's jemalloc, re-form in a child through their fork handlers. A worker whose
runtime env changes how it starts (a container, another Python, a variable the zygote's imports read), a non-Python
worker, or any failure to reach the zygote takes Ray's own path: nothing fails for want of the zygote.
RAYTF_FORKED_WORKERS=0 turns it off.
"""
from __future__ import annotations

import os

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")


def enabled() -> bool:
    return os.name == "posix" and os.environ.get("RAYTF_FORKED_WORKERS", "1") != "0"
