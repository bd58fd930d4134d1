"""The raylet's worker command (see raytf.forked_workers): a bare interpreter, no imports beyond the standard
library's, that has the node's zygote fork the worker and exits with the worker's exit code."""
import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import time

PLAIN_CONTEXT_KEYS = {"env_vars", "command_prefix", "py_executable", "override_worker_entrypoint", "java_jars"}
ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
ZYGOTE_START_TIMEOUT_S = 120


def split_args(args):
    """(runtime env context, language, the worker's own arguments): what Ray's setup_worker.py reads."""
    context, language, rest = "{}", None, []
    i = 0
    while i < len(args):
        name, equals, value = args[i].partition("=")
        if name in ("--serialized-runtime-env-context", "--language") and not equals:
            value, i = args[i + 1], i + 1
        if name == "--serialized-runtime-env-context":
            context = value or "{}"
        elif name == "--language":
            language = value
        else:
            rest.append(args[i])
        i += 1
    return context, language, rest


# Variables read while the zygote imported TensorFlow, Ray, numpy and pyarrow (or by the allocators and thread
# pools they load): a worker whose runtime env sets one of these must start fresh to see it.
IMPORT_TIME_PREFIXES = ("RAY_", "TF_", "TENSORFLOW", "KERAS", "XLA_", "CUDA", "NVIDIA", "NCCL_", "LD_", "PYTHON",
                        "OMP_", "MKL_", "OPENBLAS_", "GOTO", "NUMEXPR_", "NUMPY_", "ARROW_", "GRPC_",
                        "PROTOCOL_BUFFERS", "MALLOC", "JE_", "TCMALLOC", "TMP", "TEMP")


def forked_env(context: str, language, rest) -> dict | None:
    """The environment to fork a worker into, or None for Ray's own start: a Python worker whose runtime env
    does not change how it starts (Ray would exec the same command) and sets no variable the zygote's imports
    read. Its env_vars (Ray Tune sets some on every trial, and the actors a trial starts inherit them) are
    applied here as Ray's setup_worker.py would (`${X}` expanded, an unset one as "")."""
    try:
        ctx = json.loads(context)
    except ValueError:
        return None
    if not isinstance(ctx, dict) or os.environ.get("RAYTF_FORKED_WORKERS", "1") == "0":
        return None
    env_vars = ctx.get("env_vars") or {}
    changed = {k for k, v in ctx.items() if k in PLAIN_CONTEXT_KEYS - {"env_vars"} and v and v != sys.executable}
    read_at_import = [k for k in env_vars if k.upper().startswith(IMPORT_TIME_PREFIXES)]
    worker = bool(rest) and rest[0].endswith("default_worker.py")
    if language not in (None, "PYTHON") or changed or read_at_import or not worker:
        return None
    env = dict(os.environ)
    for key, value in env_vars.items():  # in order, each seeing the ones before it, as Ray's update_envs
        env[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", _expand(value, env))
    return env


def _expand(value: str, env: dict) -> str:
    """os.path.expandvars against `env`: `$X` and `${X}` of a set variable replaced, others left as written."""
    return re.sub(r"\$(\w+|\{[^}]*\})", lambda m: env.get(m.group(1).strip("{}"), m.group(0)), value)


def option(rest, name):
    return next((a.split("=", 1)[1] for a in rest if a.startswith(f"--{name}=")), None)


def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return s


def zygote_connection(rest):
    """A connection to this node's zygote, started here if there is none yet (one start per node: a lock)."""
    # <session>/sockets/raylet[.N]: one zygote per raylet and job. A worker takes its job id from Ray's C++
    # RayConfig, read from the environment once, when `ray._raylet` is imported: in the zygote. A worker forked for
    # another job registered under the first one's id and the raylet let it go as idle. (A zygote of TensorFlow
    # alone could serve every job, at Ray's import in each worker.)
    raylet = option(rest, "raylet-name")
    path = f"{raylet}.raytf-zygote-{os.environ.get('RAY_JOB_ID', 'none')}"
    try:
        return connect(path)
    except OSError:
        pass
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return connect(path)
        except OSError:
            pass
        logs = os.path.join(os.path.dirname(os.path.dirname(raylet)), "logs")
        log = open(os.path.join(logs if os.path.isdir(logs) else "/tmp", f"raytf-zygote.{os.getppid()}.log"), "a")
        zygote = subprocess.Popen([sys.executable, ZYGOTE, path, str(os.getppid())], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.time() + ZYGOTE_START_TIMEOUT_S
        while True:
            try:
                return connect(path)
            except OSError:
                if zygote.poll() is not None or time.time() > end:
                    raise
                time.sleep(0.05)


def main():
    args = sys.argv[1:]
    context, language, rest = split_args(args)
    env = forked_env(context, language, rest)
    if env is not None:
        try:
            conn = zygote_connection(rest)
            request = json.dumps({"argv": rest, "env": env, "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
        except OSError:
            conn = None
        if conn is not None:
            answer = b""
            try:
                while chunk := conn.recv(64):  # the child's pid, then its exit code once it ends
                    answer += chunk
            except OSError:
                pass
            lines = answer.split(b"\n")
            if len(lines) > 1:  # a worker was forked: its exit is this process's
                os._exit(int(lines[1]) if len(lines) > 2 else 1)
            # no fork (the zygote ended as it took the request, its job's last worker gone): Ray's own start
    import ray._private.workers.setup_worker as setup_worker  # Ray's own path, as if this file were not here

    os.execv(sys.executable, [sys.executable, setup_worker.__file__, *args])


if __name__ == "__main__":
    main()
