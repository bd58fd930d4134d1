"""One node's zygote (see raytf.forked_workers): Ray's worker code and TensorFlow imported once, then one fork
per worker a launcher asks for. It ends when its raylet does."""
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time

from raytf import tf_import

# Imported once here rather than in every worker: what Ray's default_worker.py imports, raytf's task actor, and
# what a task imported after the fork (a digits task: ~2 s of its wall with two at once, TensorBoard's summary API
# 1.4 s of it; a job on warm zygotes went from 2.4-2.5 s and 4.4-4.6 busy CPU-s to 2.2 s and 4.0). None of these
# starts a thread.
PRELOADED = ("ray", "ray.actor", "ray._private.node", "ray._private.parameter", "ray._private.ray_logging",
             "ray._private.runtime_env.setup_hook", "raytf.actor.task_actor",
             "ray._common.pydantic_compat", "ray._common.usage.usage_lib", "ray._private.arrow_serialization",
             "ray.util.metrics", "starlette.datastructures", "multiprocessing.queues", "multiprocessing.synchronize",
             "pydantic.v1.fields", "pyarrow.fs", "pyarrow.json", "pyarrow.parquet", "raytf.metrics",
             "tensorboard.summary.v2")
RAYLET_CHECK_S = 0.5
IDLE_EXIT_S = 30.0  # a zygote serves one job (see launcher.py): with no worker of it left for this long, it ends


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size, body = int.from_bytes(message[:8], "big"), message[8:]
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


def become_worker(request: dict, fds: list[int], conn: socket.socket, server: socket.socket) -> None:
    """In the forked child: the launcher's output files, environment and working directory, then Ray's
    default_worker.py as its own main module. Ends with the launcher (the raylet's handle on this worker)."""
    os.setsid()  # a group of its own, as a worker the raylet starts (Ray may signal a worker's whole group)
    server.close()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])

    def end_with_launcher():
        try:
            while conn.recv(1):
                pass
        finally:
            os._exit(1)

    threading.Thread(target=end_with_launcher, daemon=True).start()
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(sys.argv[0])  # as `python default_worker.py` has it
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 -- said on the worker's stderr, as Python would
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str, raylet_pid: int) -> None:
    server = socket.socket(socket.AF_UNIX)
    if os.path.exists(path):
        os.unlink(path)
    server.bind(path)
    server.listen(64)
    launchers: dict[int, socket.socket] = {}  # worker pid -> its launcher's connection
    busy_at = time.monotonic()
    try:
        while True:
            ready, _, _ = select.select([server], [], [], RAYLET_CHECK_S)
            _reap(launchers)
            if launchers:
                busy_at = time.monotonic()
            try:
                os.kill(raylet_pid, 0)
            except ProcessLookupError:
                return
            if not ready:
                if time.monotonic() - busy_at > IDLE_EXIT_S:
                    return
                continue
            conn, _ = server.accept()
            try:
                request, fds = receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                for other in launchers.values():
                    other.close()
                become_worker(request, fds, conn, server)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            launchers[pid] = conn
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _reap(launchers: dict[int, socket.socket]) -> None:
    """Each ended worker's exit code to its launcher, which then exits with it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = launchers.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


if __name__ == "__main__":
    # TensorFlow's C++ logging reads its level once, here: raytf's default for its tasks (raytf.driver.packaging)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf_import.import_tensorflow()
    for module in PRELOADED:
        try:
            importlib.import_module(module)
        except ImportError:  # one this install lacks is the worker's to import or do without, as it would be
            pass
    serve(sys.argv[1], int(sys.argv[2]))
