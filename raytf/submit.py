"""raytf jobs through the Ray Jobs API (the dashboard's HTTP endpoint on the head, port 8265): submit,
follow, status, logs, stop.

A submitted job is `raytf run <job file> [--set ...]` run by the cluster as the Jobs API entrypoint, with
the job file's folder uploaded as its working directory: the job's code and data travel with it, and
inside the job raytf finds the cluster through the RAY_ADDRESS the Jobs API sets. Its exit code comes
back as the job's `driver_exit_code`, so 1 (training failed), 2 (bad spec) and 3 (no resources in time)
reach the submitter unchanged.

Every request has a deadline (Ray's client sends without one), and following a job gives up, saying so,
when the cluster has not answered for LOST_CONTACT_S.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shlex
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

import requests
from ray.exceptions import AuthenticationError
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

from raytf import job as job_lib
from raytf.driver import packaging, session
from raytf.errors import RaytfError, SpecError
from raytf.storage import is_uri

DEFAULT_ADDRESS = "http://127.0.0.1:8265"  # where `ray dashboard cluster.yaml` forwards the head's dashboard
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # an upload of the job folder is answered only once the head has stored it
POLL_READ_TIMEOUT_S = 20.0  # status polls while following: short, so Ctrl-C is never stuck behind one
POLL_S = 2.0  # no log output for this long: ask for the job's status
AGENT_WAIT_S = 60.0  # a head just started: how long a submission may wait for its job agent to come up
LOST_CONTACT_S = 60.0  # following: no answer from the cluster for this long -> stop following, say so
END_GRACE_S = 10.0  # after the job ends: wait this long for the last log lines and the final status
NO_AGENT = "No available agent to submit job"  # Ray's answer while the head's job agent is not up yet
EXIT_STOPPED = 4  # the job was stopped (raytf stop, ray job stop) before it finished
EXIT_UNREACHABLE = 5  # the Jobs API could not be reached, refused the token, or answered with an error


class ClusterUnreachable(RaytfError):
    """The Jobs API did not answer, refused our token, or answered with an error. `reason`: the cause in
    a few words, for messages that wrap this one."""

    exit_code = EXIT_UNREACHABLE

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


class JobNotFound(RaytfError):
    """No job with this submission id on the cluster."""

    exit_code = 1


@dataclasses.dataclass(frozen=True)
class Submission:
    """What goes to the Jobs API for one job file: pure data, built without contacting the cluster."""

    name: str
    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]
    job_dir: Path
    left_out: str | None = None  # raytf's line naming the credential files the package leaves out
    results: str = ""  # where the run's results end up, said to the user



# ---------------------------------------------------------------- preparing


def prepare(job_file: str | Path, settings: Sequence[str] = (), verbose: bool = False) -> Submission:
    """Check the spec's shape here (pure: no user code imported, no data read, so a job whose data only
    the cluster can see still submits) and build the entrypoint and runtime env. The full check (modules,
    data, Keras names) runs on the cluster and comes back as exit code 2."""
    path = Path(job_file).expanduser().resolve()
    job = job_lib.read_job(job_file, settings)
    spec = job.spec
    try:
        entry_file = path.relative_to(job.job_dir).as_posix()
    except ValueError:
        raise SpecError(f"{job_file}: raytf submit uploads base_dir {job.job_dir} as the job's working directory, "
                        f"and the job file is outside it; move the job file into that folder") from None
    left_out = packaging.check_job_folder(job)
    argv = ["raytf", "run", entry_file, *(["--verbose"] if verbose else [])]
    for item in settings:
        argv += ["--set", item]
    runtime_env = packaging.runtime_env(job)
    # The driver's output reaches the log stream as it is written, not when a buffer fills.
    runtime_env["env_vars"]["PYTHONUNBUFFERED"] = "1"
    metadata = {"raytf_job": spec.name, "job_file": entry_file}
    if is_uri(job.output_where):
        metadata[OUTPUT_KEY] = job.output_where  # `raytf status` reads the run's state from there
    return Submission(name=spec.name, submission_id=f"raytf-{spec.name}-{uuid.uuid4().hex[:8]}",
                      entrypoint=shlex.join(argv), runtime_env=runtime_env, metadata=metadata, job_dir=job.job_dir,
                      left_out=left_out, results=results_note(job))


OUTPUT_KEY = "raytf_output"  # the job's metadata key holding its output.dir URI


def results_note(job: job_lib.Job) -> str:
    """Where a submitted run's results go. The driver runs on the head, in Ray's temporary copy of the job
    folder: a local output.dir lands there and goes when Ray cleans it up; a URI keeps them."""
    where = job.output_where
    if is_uri(where):
        return f"raytf: results go to {where} (`raytf results {where}` reads them)"
    try:
        inside = Path(where).relative_to(job.job_dir).as_posix()
        return (f"raytf: results go to {inside}/ in the head's temporary copy of the job folder, which Ray removes; "
                f"set output.dir to a URI (e.g. --set output.dir=s3://bucket/runs/{job.spec.name}) to keep them")
    except ValueError:
        return f"raytf: results go to {where} on the head node"


def resolve_address(address: str | None) -> str:
    """--address, else RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else the port-forwarded default.
    `host:port` means http://host:port, as in Ray's own client."""
    chosen = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    if "://" not in chosen:
        chosen = f"http://{chosen}"
    scheme = chosen.split("://", 1)[0]
    if scheme not in ("http", "https"):
        raise ClusterUnreachable(f"--address {chosen!r}: raytf submit talks to the Ray Jobs API over HTTP; "
                                 f"use the dashboard URL, e.g. http://127.0.0.1:8265 (after `ray dashboard cluster.yaml`)")
    host = urllib.parse.urlsplit(chosen).hostname
    if not host or any(c.isspace() for c in chosen):
        raise SpecError(f"--address {chosen!r} is not a URL; give the Jobs API as http://HOST:PORT, e.g. "
                        f"http://127.0.0.1:8265")
    return chosen.rstrip("/")


# ---------------------------------------------------------------- talking to the cluster


class _Client(JobSubmissionClient):
    """Ray's client with a deadline on every HTTP request: without one, a head that accepts the
    connection and never answers would hang the caller forever."""

    def __init__(self, address: str, read_timeout_s: float = READ_TIMEOUT_S):
        self._raytf_timeout = (CONNECT_TIMEOUT_S, read_timeout_s)
        super().__init__(address)

    def _do_request(self, method, endpoint, **kwargs):  # Ray-private hook; raytf pins Ray 2.60.*
        kwargs.setdefault("timeout", self._raytf_timeout)
        return super()._do_request(method, endpoint, **kwargs)


class Jobs:
    """One Jobs API endpoint. Every call either answers or raises a RaytfError with a one-line cause."""

    def __init__(self, address: str | None = None, read_timeout_s: float = READ_TIMEOUT_S,
                 allow_http_token: bool = False):
        self.address = resolve_address(address)
        self.read_timeout_s, self.allow_http_token = read_timeout_s, allow_http_token
        # The token goes only where it cannot be read on the way (session.token_may_travel); elsewhere Ray's
        # client is told not to send it, and a cluster that asks for it is answered with why (_call).
        self.token_withheld = (session.token_available()
                               and not session.token_may_travel(self.address, allow_http_token))
        if self.token_withheld:
            session.set_auth_mode("disabled")
        elif session.auth_mode_for(self.address) == "token":  # a user with a token means to send it
            session.set_auth_mode("token")
        # Ray's client lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override the address it is given;
        # an explicit --address must win, so they are hidden while it is built.
        with _env_without("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
            self.client = self._call("connecting", lambda: _Client(self.address, read_timeout_s))

    def submit(self, sub: Submission, agent_wait_s: float = AGENT_WAIT_S) -> str:
        """Submit the job. A head that has just started answers 500 "No available agent" (its job agent
        had not registered within Ray's 10 s) until the agent is up: that is asked again, not failed."""
        deadline = time.monotonic() + agent_wait_s
        while True:
            try:
                return self._call(f"submitting {sub.job_dir}", lambda: self.client.submit_job(
                    entrypoint=sub.entrypoint, runtime_env=sub.runtime_env, submission_id=sub.submission_id,
                    metadata=sub.metadata))
            except ClusterUnreachable as exc:
                if NO_AGENT not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(1.0)

    def info(self, job_id: str) -> JobDetails:
        return self._call(f"asking for job {job_id}", lambda: self.client.get_job_info(job_id), job_id)

    def logs(self, job_id: str) -> str:
        return self._call(f"reading the logs of job {job_id}", lambda: self.client.get_job_logs(job_id), job_id)

    def stop(self, job_id: str, timeout_s: float = 60.0, poll_s: float = 0.5) -> tuple[JobDetails, bool]:
        """Stop the job and wait until the cluster says it has ended. Returns (final details, whether
        this call stopped it); a job that had already ended is left as it was."""
        info = self.info(job_id)
        if info.status.is_terminal():
            return info, False
        self._call(f"stopping job {job_id}", lambda: self.client.stop_job(job_id), job_id)
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info(job_id)
            if info.status.is_terminal():
                return info, True
            if time.monotonic() > deadline:
                raise RaytfError(f"job {job_id} is still {info.status} {timeout_s:g}s after the stop request; "
                                 f"check again with `raytf status {job_id} --address {self.address}`")
            time.sleep(poll_s)

    def follow(self, job_id: str, out: TextIO | None = None, note: Callable[[str], None] | None = None) -> JobDetails:
        """Copy the job's log stream to `out` until the job ends; return its final details.

        The stream is the Jobs API's websocket tail. Whenever it is quiet for POLL_S the job's status is
        asked for, so a job that ended, a stream that broke and a cluster that went away are all noticed;
        LOST_CONTACT_S without any answer raises ClusterUnreachable."""
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)  # "WebSocket closed ..."
        return asyncio.run(self._follow(job_id, out or sys.stdout, note or (lambda text: None)))

    async def _follow(self, job_id: str, out: TextIO, note: Callable[[str], None]) -> JobDetails:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in self.client.tail_job_logs(job_id):
                    queue.put_nowait(chunk)
            except Exception as exc:  # the stream broke; status polls still end the wait
                queue.put_nowait(exc)
            else:
                queue.put_nowait(None)  # the server closes the stream once the job has ended

        poller = Jobs(self.address, POLL_READ_TIMEOUT_S, self.allow_http_token)  # same endpoint, a short deadline for the polls
        last_answer = time.monotonic()
        ended_at: float | None = None
        streaming = True
        task = asyncio.create_task(pump())
        try:
            while True:
                item: Any = _QUIET
                if streaming:
                    with contextlib.suppress(asyncio.TimeoutError):
                        item = await asyncio.wait_for(queue.get(), timeout=POLL_S)
                else:
                    await asyncio.sleep(POLL_S)
                if isinstance(item, str):
                    out.write(item)
                    out.flush()
                    continue
                if item is None:
                    streaming = False
                    ended_at = ended_at or time.monotonic()
                elif isinstance(item, BaseException):
                    streaming = False
                    note(f"raytf: the log stream broke ({_one_line(item)}); waiting for the job to end "
                         f"(`raytf logs {job_id}` shows its output)")
                try:
                    info = await asyncio.to_thread(poller.info, job_id)
                    last_answer = time.monotonic()
                except ClusterUnreachable as exc:  # a missing job (JobNotFound) ends the wait at once
                    if time.monotonic() - last_answer > LOST_CONTACT_S:
                        raise ClusterUnreachable(
                            f"lost contact with {self.address} for {LOST_CONTACT_S:g}s while following job {job_id} "
                            f"({exc.reason}); it may still be running: `raytf status {job_id} --address {self.address}`"
                        ) from None
                    continue
                if info.status.is_terminal():
                    ended_at = ended_at or time.monotonic()
                    if not streaming or time.monotonic() - ended_at > END_GRACE_S:
                        return info
                elif ended_at is not None and time.monotonic() - ended_at > END_GRACE_S:
                    # The stream said "ended" but the status lags; trust the status, and keep asking.
                    ended_at = None
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    # -- errors

    def _call(self, what: str, fn: Callable[[], Any], job_id: str | None = None) -> Any:
        """Run one request; turn every way it can fail into a one-line RaytfError naming the fix."""
        try:
            return fn()
        except AuthenticationError as exc:
            if "Authentication failed" in str(exc):  # 403: a token was sent and refused
                raise ClusterUnreachable(
                    f"the Ray cluster at {self.address} refused raytf's token while {what}: use the cluster's "
                    f"token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; the one mounted by "
                    f"`ray up cluster.yaml`)") from None
            if self.token_withheld:
                raise ClusterUnreachable(
                    f"the Ray cluster at {self.address} requires token authentication, and raytf does not send "
                    f"your token over plain http to an address other than this machine (anyone on the way could "
                    f"read it and run code on the cluster): use https, or the SSH port-forward of `ray dashboard "
                    f"cluster.yaml` (http://127.0.0.1:8265), or, on a network you trust, pass --allow-http-token "
                    f"(or set {session.ALLOW_HTTP_TOKEN}=1)") from None
            fix = ("unset RAY_AUTH_MODE (it is 'disabled') or export RAY_AUTH_MODE=token, and "
                   if os.environ.get(session.AUTH_MODE, "").lower() == "disabled" else "")
            raise ClusterUnreachable(
                f"the Ray cluster at {self.address} requires token authentication and raytf sent no token "
                f"while {what}: {fix}put the cluster's token in ~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH, "
                f"RAY_AUTH_TOKEN); `ray get-auth-token` on the head prints it") from None
        except (requests.exceptions.ConnectionError, ConnectionError) as exc:  # includes ConnectTimeout
            raise ClusterUnreachable(
                f"cannot reach the Ray Jobs API at {self.address} while {what} ({_reason(exc)}): start the "
                f"port-forward with `ray dashboard cluster.yaml`, or pass --address http://HEAD:8265 "
                f"(the dashboard port, not the GCS port 6379)", reason=_reason(exc)) from None
        except requests.exceptions.Timeout:
            raise ClusterUnreachable(f"no answer from the Ray Jobs API at {self.address} within "
                                     f"{self.read_timeout_s:g}s while {what}; is the head overloaded or the "
                                     f"port-forward (`ray dashboard cluster.yaml`) stuck?",
                                     reason=f"no answer within {self.read_timeout_s:g}s") from None
        except (RuntimeError, ValueError, requests.exceptions.RequestException) as exc:
            message = _one_line(exc)
            if job_id is not None and ("does not exist" in message or "status code 404" in message):
                raise JobNotFound(f"no job {job_id!r} on the Ray cluster at {self.address}; "
                                  f"`ray job list --address {self.address}` lists them") from None
            if "Version check returned 404" in message or isinstance(exc, requests.exceptions.JSONDecodeError):
                raise ClusterUnreachable(f"{self.address} answers HTTP but is not a Ray Jobs API (dashboard); "
                                         f"pass the head's dashboard URL, e.g. http://127.0.0.1:8265") from None
            raise ClusterUnreachable(f"the Ray Jobs API at {self.address} failed while {what}: {message}") from None


_QUIET = object()  # no log output within POLL_S


@contextlib.contextmanager
def _env_without(*names: str) -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _reason(exc: BaseException) -> str:
    """requests wraps the socket error several levels deep, and Ray re-raises it as a bare
    "Failed to connect"; the original's words are the useful ones."""
    text = f"{exc} {exc.__context__ or ''}"
    for marker in ("Connection refused", "Name or service not known", "No route to host", "timed out",
                   "Temporary failure in name resolution", "Connection reset", "Network is unreachable"):
        if marker in text:
            return marker.lower()
    return _one_line(exc, 120)


# ---------------------------------------------------------------- outcome


def exit_code(info: JobDetails) -> int:
    """0 succeeded; the driver's own code when it failed (1 training, 2 spec, 3 resources, 130);
    1 when it failed before raytf ran (runtime env, entrypoint start); 4 when it was stopped."""
    if info.status == JobStatus.SUCCEEDED:
        return 0
    if info.status == JobStatus.STOPPED:
        return EXIT_STOPPED
    code = info.driver_exit_code
    if code is None or code == 0:
        return 1
    if code < 0:  # killed by a signal: the shell's convention
        return min(128 - code, 255)
    return min(code, 255)


def cause(info: JobDetails) -> str | None:
    """One line saying why a job did not succeed: raytf's own error line from the log tail Ray keeps in
    the job's message, else the last line of that tail, else the message's first line."""
    if info.status == JobStatus.SUCCEEDED or not info.message:
        return None
    lines = [line.strip() for line in info.message.splitlines() if line.strip()]
    errors = [line for line in lines if "raytf: error:" in line]
    if errors:
        text = errors[-1].split("raytf: error:", 1)[1].strip()
    elif len(lines) > 1 and "last available logs" in lines[0]:
        text = lines[-1]
    else:
        text = lines[0]
    return text if len(text) <= 500 else text[:500] + "..."


def describe(job_id: str, info: JobDetails) -> str:
    """`raytf: job ID SUCCEEDED` / `... FAILED (exit code 2): data.train: ...`"""
    text = f"raytf: job {job_id} {info.status}"
    if info.driver_exit_code not in (None, 0):
        text += f" (exit code {info.driver_exit_code})"
    why = cause(info)
    if why:
        text += f": {why}"
    return text
