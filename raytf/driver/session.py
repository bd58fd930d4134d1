"""Which Ray to use: the one already initialised in this process, an existing cluster (--address, or
RAY_ADDRESS as set by `ray job submit`), or an embedded local Ray started for this run and shut down after."""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Iterator

import ray

from raytf import forked_workers, metrics
from raytf.actor import scratch
from raytf.errors import RaytfError

AUTH_MODE = "RAY_AUTH_MODE"
_embedded = False  # whether this process's Ray is one raytf started for the run (it cannot grow)
_abandoned = False  # an embedded Ray found stopped under us (by the signal that stopped the driver): not shut down
SHUTDOWN_GRACE_S = 5.0  # for an embedded Ray's workers to exit, which they do once its raylet is gone


def token_available() -> bool:
    """Whether this user has a Ray token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).expanduser().is_file()


def auth_mode_for(address: str | None) -> str | None:
    """RAY_AUTH_MODE to set before connecting, or None to leave it as it is. Ray 2.60 sends its token to
    an explicit address only with RAY_AUTH_MODE=token; a user whose token file exists means to use it.
    An embedded Ray turns token auth on by itself (and says so in a warning): saying it first is quieter."""
    if os.environ.get(AUTH_MODE) is not None:
        return None  # the user's choice
    if address is None or token_available():
        return "token"
    return None


ALLOW_HTTP_TOKEN = "RAYTF_ALLOW_HTTP_TOKEN"  # =1: send the token over plain HTTP to any address (opt-in)


def token_may_travel(url: str, allowed: bool = False) -> bool:
    """Whether the cluster token may go to `url` (the Jobs API): over https, or over plain http only to this
    machine (the SSH port-forward of `ray dashboard cluster.yaml`), unless the user opted in. Over plain http
    to another address, whoever listens there (a typo, a stale RAY_ADDRESS) would get code execution on the
    cluster."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parsed.scheme == "https" or allowed or os.environ.get(ALLOW_HTTP_TOKEN) == "1":
        return True
    host = (parsed.hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


@contextlib.contextmanager
def ray_session(address: str | None = None, verbose: bool = False) -> Iterator[str | None]:
    """Yields where the workers' logs are when they are not shown here (None when they are, or when
    this process's Ray was initialised by someone else)."""
    global _abandoned
    if ray.is_initialized():
        yield None
        return
    _abandoned = False  # a session before this one, in the same process (a notebook), is not this one
    address = address or os.environ.get("RAY_ADDRESS") or None
    mode = auth_mode_for(address)
    if mode is not None:  # for this session only (a client sending a token to a cluster without auth is fine)
        set_auth_mode(mode)
    # Workers' output (TensorFlow's start-up lines among it) reaches this terminal with --verbose only.
    options = dict(log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.WARNING)
    started = time.time()
    term = signal.getsignal(signal.SIGTERM)  # ray.init puts its own (sys.exit) over the caller's
    try:
        if address:
            check_reachable(address)
            metrics.driver_exports_every_second()  # a cluster's node may keep the job state's gauge only 2 s
            _init(address, options)
            hint = "on each node under its Ray session folder (/tmp/ray/session_latest/logs), or `ray logs`"
        else:
            # "local": a fresh Ray of our own. A bare ray.init() would join whatever cluster was started
            # last on this machine (/tmp/ray/ray_current_cluster) -- someone else's, or a test's.
            _init_embedded(dict(include_dashboard=False, _system_config=EMBEDDED_RAY_CONFIG, **options))
            _set_embedded(True)
            hint = _local_logs()
        _keep_handler(signal.SIGTERM, term)
        keep_token_private()
        yield None if verbose else f"raytf: workers' logs: {hint} (-v shows them here)"
    finally:
        _abandoned = embedded_ray_gone()  # ray.shutdown would wait out the reconnect to its dead GCS, then abort
        _set_embedded(False)
        if not _abandoned:
            ray.shutdown()
        # Ray's native shutdown leaves SIGTERM at its default behind Python's back (the process then dies
        # without a word, even in the middle of shipping results): the caller's handler goes back in.
        _keep_handler(signal.SIGTERM, term)
        if not address:  # its tasks are gone with it: what the killed ones left on this disk goes too
            scratch.sweep(tempfile.gettempdir(), grace_s=SHUTDOWN_GRACE_S, since=started)
        if mode is not None:
            set_auth_mode(None)


# An embedded Ray's node starts no idle Python workers ahead of need: Ray prestarts one per CPU when the first
# driver connects. While raytf's task actors carried a runtime env (the job folder), no prestarted worker could
# serve them: `raytf run jobs/digits.yaml` took 0.96x the wall time and 0.93x the busy CPU without them. Now that
# they carry none (raytf.driver.packaging.pack_code) a prestarted worker could, and the two measure the same
# (0.99x wall, 1.01x CPU without them); none are started, so a node where no task lands idles no process
# (BENCHMARKS.md, benchmarks/bench_embedded_start.py).
EMBEDDED_RAY_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


def _init(address: str, options: dict) -> None:
    """ray.init, its failure one line (Ray's own is a long traceback from deep inside it). `address`: a
    cluster's, or "local" for an embedded Ray of our own."""
    try:
        ray.init(address=address, **options)
    except Exception as exc:  # noqa: BLE001 -- whatever Ray raises, the user needs the first line and the place
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        where = "an embedded local Ray" if address == "local" else f"the Ray cluster at {address}"
        raise RaytfError(f"could not connect to {where} ({first}); -v shows Ray's own output") from None


# Ray gives a new node's raylet a fixed 30 s to register with the GCS; on a machine whose cores are all busy it
# once took longer (a test suite's other worker starting clusters meanwhile). One more start is tried then.
NODE_START_TIMEOUT = "The current node timed out during startup"


def _init_embedded(options: dict) -> None:
    with _embedded_node_processes():
        try:
            _init("local", options)
        except RaytfError as exc:
            if NODE_START_TIMEOUT not in str(exc):
                raise
            ray.shutdown()  # whatever the first start left running
            _init("local", options)


@contextlib.contextmanager
def _embedded_node_processes() -> Iterator[None]:
    """How the embedded Ray's processes are started (Ray-private hooks; raytf pins Ray 2.60.*):

    - Each in a process group of its own (GCS, raylet, and through it the task actors), as Ray itself does on
      Windows. A signal to the driver's whole group (`timeout`, Slurm, `kill -- -PGID`) then reaches the driver
      alone, which takes the Ctrl-C path and stops them. In the driver's group the raylet died of the same
      signal, and the driver's Ray client then ended the process at its next object-store call: exit 1, no word
      (seen once under load, the SIGTERM test). They still die with the driver: Ray starts them with the
      kernel's parent-death signal (this is done only where Linux has it).
    - Without the autoscaler's monitor: one node that cannot grow has nothing to scale, and raytf answers an
      unplaceable request itself (raytf.driver.placement). Its Python process cost CPU at every start, and at
      every ray.shutdown 1 s: on SIGTERM it reports to the GCS already stopped, until Ray kills it.
    - Without the dashboard's API server, which Ray starts even with include_dashboard=False (for the state and
      job APIs, which nothing reaches on an embedded Ray): 1.6 of a short run's 27 CPU-s. Ray's own path when
      that server fails to start is the same: no dashboard URL, nothing else missing.
    - Its workers forked from a zygote that has imported TensorFlow (raytf.forked_workers)."""
    from ray._private import node, services, utils

    replacements = {(node.Node, "start_monitor"): lambda self: None,
                    (node.Node, "start_api_server"): lambda self, **kwargs: None}
    if forked_workers.enabled():
        replacements[(node.Node, "__init__")] = _with_forked_workers(node.Node.__init__)
    if hasattr(services, "ConsolePopen") and os.name == "posix" and utils.detect_fate_sharing_support():
        replacements[(services, "ConsolePopen")] = _in_own_group(services.ConsolePopen)
    saved = {(owner, name): getattr(owner, name) for owner, name in replacements if hasattr(owner, name)}
    for (owner, name) in saved:
        setattr(owner, name, replacements[owner, name])
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def _with_forked_workers(node_init):
    """Ray's Node.__init__, its raylet starting workers through raytf's launcher (where none other is set)."""
    def init(self, ray_params, *args, **kwargs):
        if ray_params.setup_worker_path is None:
            ray_params.setup_worker_path = forked_workers.LAUNCHER
        node_init(self, ray_params, *args, **kwargs)

    return init


def _in_own_group(popen: type) -> type:
    """`popen` (Ray's Popen class) starting each process as the leader of a process group of its own."""
    class OwnGroupPopen(popen):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    return OwnGroupPopen


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """An explicit HOST:PORT (or ray://HOST:PORT) that nothing answers is said at once: Ray's client would
    wait for it far longer. "auto" and names Ray resolves itself are left to Ray."""
    parsed = urllib.parse.urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        raise RaytfError(f"--address {address}: not HOST:PORT; give e.g. 127.0.0.1:6379 or auto") from None
    if not host or port is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise RaytfError(f"no Ray cluster answers at {address} ({exc.strerror or exc}); start one (ray start "
                         f"--head) or leave --address out for an embedded local Ray") from None


def keep_token_private() -> None:
    """The cluster token file readable by its owner only. An embedded Ray writes ~/.ray/auth_token when there
    is none, with the process's umask (often world-readable), and anyone who reads it can run code on Ray."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    try:
        if path.is_file() and path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except OSError:  # not ours to change: Ray's own checks apply
        pass


def _keep_handler(signum: int, handler) -> None:
    """Put back a Python handler the caller had (raytf's CLI: SIGTERM takes the Ctrl-C path) over Ray's."""
    if callable(handler):
        try:
            signal.signal(signum, handler)
        except ValueError:  # not the main thread: Ray could not have replaced it either
            pass


def embedded() -> bool:
    """Whether this process's Ray is an embedded local one raytf started: no autoscaler, no other nodes, so
    what its node does not hold now it never will (raytf.driver.placement answers such a request at once)."""
    return _embedded


def embedded_ray_gone() -> bool:
    """Whether this process's embedded Ray no longer answers: a signal to the whole process group (`timeout`, a
    terminal's group) ends Ray's processes with the driver (the GCS stops serving, its process may linger).
    Then nothing is left to release, and a call to Ray would wait out its reconnect timeout."""
    if not _embedded:
        return False
    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return True
    return False


def ray_abandoned() -> bool:
    """Whether the run's embedded Ray was left without ray.shutdown (it had stopped with the driver's signal):
    the process must then exit without Ray's own exit hook, which would wait on the same dead GCS."""
    return _abandoned


def _set_embedded(value: bool) -> None:
    global _embedded
    _embedded = value


def set_auth_mode(mode: str | None) -> None:
    """Set (or unset) RAY_AUTH_MODE for this process. Ray reads it into its cached config, so that is
    refreshed too, as Ray's own `_enable_token_auth` does (Ray-private; raytf pins Ray 2.60.*)."""
    from ray._raylet import Config

    if mode is None:
        os.environ.pop(AUTH_MODE, None)
    else:
        os.environ[AUTH_MODE] = mode
    Config.initialize("")


def _local_logs() -> str:
    try:
        return os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    except AttributeError:  # Ray's private layout moved
        return "/tmp/ray/session_latest/logs"


def cluster_identity() -> dict[str, str]:
    """Which Ray cluster this process drives, for a run's attempts: its session (new with every cluster
    start) and its GCS address."""
    context = ray.get_runtime_context()
    return {"session": context.get_session_name(), "address": context.gcs_address}
