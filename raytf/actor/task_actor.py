"""The Ray actor behind one TF task: it reports where it runs, holds a port, sets TF_CONFIG before
TensorFlow starts, runs the strategy loop, and answers progress queries while the loop runs.

TensorFlow is imported only in `setup`, after TF_CONFIG is in the environment. In a sweep, an actor whose
job succeeded may be set up again for the next trial on the same placement group, with the same TF_CONFIG
(raytf.actor.reuse): `setup` runs once per job.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import socket
import tempfile
import threading
import time
from typing import Any

import ray

from raytf import tf_import
from raytf.actor import raised, scratch, task_code, workdir
from raytf.actor.channel import TaskChannel
from raytf.actor.context import TaskContext
from raytf.protocol import OUTPUTS, Outcome, Progress, StopAnswer, TaskCode, WorkerPayload
from raytf.rendezvous import ActorLocation, Task

# How long a failed task gives its checkpoint upload in flight to finish before it reports the failure, and a
# task being stopped before its folder goes (the driver kills it CLEANUP_TIMEOUT_S = 2 s after asking).
UPLOAD_SETTLE_S = 10.0
UPLOAD_SETTLE_AT_STOP_S = 1.5


class TaskActor:
    """Created with max_concurrency=2, so `progress` is answered while `train` runs."""

    def __init__(self, bundle_index: int, port: int = 0, code: TaskCode | None = None):
        self._bundle_index = bundle_index
        # the job folder on this node, shared by its tasks (none given: the working directory, as a test's)
        self._job_root = task_code.install(code) if code is not None else os.getcwd()
        # Hold the port until TensorFlow binds it, so no other process takes it meanwhile. TF's gRPC
        # server does not set SO_REUSEPORT, so the hold is released right before TF starts. A given port
        # is a replacement taking over a dead task's address.
        self._held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._held.bind(("", port))
        self._port = self._held.getsockname()[1]
        self._channel: TaskChannel | None = None  # what the driver polls while train runs
        self._ctx: TaskContext | None = None  # what the loop (and a train_fn) sees of this task
        self._task: Task | None = None
        self._adopted_gpus: tuple[str, ...] | None = None
        self._backend = None  # the strategy's actor half (raytf.actor.<name>), imported in setup
        self._started = None  # what it started: the strategy, or a parameter-server task's TF server
        self._scratch = self._staging = None  # this task's folder on the node, made in setup
        self._tempdir_before = tempfile.tempdir
        self._jobs = 0  # jobs set up in this process (more than one: a sweep's trials, one after another)
        self._training_thread: int | None = None  # the thread `train` runs in (its stack leads a hang's report)
        self._training = False  # whether a `train` call is running (a survivor on its way out of a failed step)
        # Import TensorFlow while the rendezvous goes on (seconds of CPU; reading TF_CONFIG and starting
        # the server happen later, in setup). setup waits for this import through Python's import lock.
        self._tf_import = threading.Thread(target=tf_import.import_tensorflow, daemon=True)
        self._tf_import.start()

    def location(self) -> ActorLocation:
        ctx = ray.get_runtime_context()
        gpu_ids = self._adopted_gpus if self._adopted_gpus is not None else tuple(str(g) for g in ray.get_gpu_ids())
        return ActorLocation(bundle_index=self._bundle_index, node_id=ctx.get_node_id(),
                           node_ip=ray.util.get_node_ip_address(), port=self._port, gpu_ids=gpu_ids,
                           cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def adopt(self, gpu_ids: tuple[str, ...], cuda_visible_devices: str | None) -> ActorLocation:
        """A warm standby (started with no resources of its own, TensorFlow already imported) takes the
        place of a dead task in its bundle: the GPUs Ray gave that task become this process's, set before
        TensorFlow initialises any device (importing it does not)."""
        self._adopted_gpus = tuple(gpu_ids)
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        return self.location()

    def release_port(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def setup(self, task: Task, tf_config: str, world_size: int, payload: WorkerPayload) -> dict[str, Any]:
        """Set TF_CONFIG, then let the strategy's actor half bring up its part (a server, the strategy).
        A port lost to another process surfaces as PortTaken, which the controller answers with a fresh
        rendezvous. Any other exception reaches the driver as a TaskException (raytf.actor.raised)."""
        try:
            return self._setup(task, tf_config, world_size, payload)
        except Exception as exc:
            raise raised.capture(exc, [self._job_root, payload.job_dir]) from None

    def _setup(self, task: Task, tf_config: str, world_size: int, payload: WorkerPayload) -> dict[str, Any]:
        from raytf import backends
        from raytf.errors import PortTaken

        self._task = task
        self._jobs += 1
        _name_this_actor(f"raytf:{payload.spec.name}:{task.role}-{task.index}")
        if self._scratch is None:
            self._make_scratch()
        os.environ["TF_CONFIG"] = tf_config  # an evaluator's names the cluster it is not part of, as TF's do
        if self._channel is not None:  # a setup again (a fresh rendezvous, a sweep's next trial)
            self._channel.end_series()
        self._channel = TaskChannel(task.rank, series=_series(task, payload.spec))
        self._ctx = TaskContext(task.rank, world_size, payload.spec, self._staging, payload, self._channel)
        self._ctx.output_dir = self._workdir
        self._tf_import.join()
        import tensorflow as tf

        if self._jobs > 1:  # what _configure_process set stays as the first job set it (part of the reuse key)
            from raytf.actor import reuse

            self._started = None  # the last job's strategy goes with the rest of its state
            reuse.fresh_start()
        else:
            _configure_process(tf, task, payload.spec)
        self._backend = importlib.import_module(backends.get(payload.spec.strategy).actor_module)
        self._backend.prepare(task, payload, self._ctx)  # before any server is up: peers may read at once
        self.release_port()
        try:
            self._started = self._backend.start(task, payload, self._ctx)
        except tf.errors.UnknownError as exc:
            if "Could not start gRPC server" in str(exc):
                raise PortTaken(f"rank {task.rank}: port {task.port} on {task.node_ip} was taken before "
                                f"TensorFlow could bind it") from None
            raise
        return {"rank": task.rank, "role": task.role}

    def _make_scratch(self) -> None:
        """This task's files on the node (raytf.actor.scratch): `staging` is shipped back to output.dir, and
        Python's temp files (AutoGraph's sources, checkpoint copies) go to `tmp`, so that they leave with
        the folder also when the task is killed, which runs no cleanup. Made here, not when the actor
        starts: a warm standby that is never promoted leaves nothing."""
        self._scratch = scratch.Scratch()
        self._scratch_root = os.path.dirname(self._scratch.path)  # where this node's tasks keep theirs
        self._staging = os.path.join(self._scratch.path, "staging")
        os.mkdir(self._staging)
        os.mkdir(os.path.join(self._scratch.path, "tmp"))
        tempfile.tempdir = os.path.join(self._scratch.path, "tmp")
        self._workdir = workdir.enter(self._job_root, os.path.join(self._scratch.path, "work"))  # relative writes
        self._sweep_node()

    def _sweep_node(self) -> None:
        """Remove, in the background, the folders of this node's dead tasks, beside this one's."""
        threading.Thread(target=scratch.sweep, args=(self._scratch_root,), daemon=True).start()

    def train(self, payload: WorkerPayload) -> Outcome:
        started = time.time()
        self._training_thread = threading.get_ident()
        self._training = True
        try:
            try:
                outcome = self._backend.train(self._started, self._task, payload, self._ctx)
                self._ctx.checkpoint_uploads.complete()  # the last checkpoint is in checkpoint.dir before "done"
            except Exception as exc:
                self._ctx.checkpoint_uploads.settle(UPLOAD_SETTLE_S)  # before cleanup removes its files
                raise raised.capture(exc, [self._job_root, payload.job_dir]) from None
            # artifacts: the chief's model and events, and what the script wrote into its working folder
            # (outputs/); any rank's profile
            artifacts = _collect(self._staging)
            if self._ctx.is_chief:
                artifacts.update(workdir.written(self._workdir, prefix=OUTPUTS))
                if "keras" in outcome.exports:  # loaded here as a user would, before it is announced
                    outcome = dataclasses.replace(outcome, load_note=_load_note(self._staging, payload.spec))
            return dataclasses.replace(outcome, rank=self._ctx.rank, started_at=started, finished_at=time.time(),
                                       first_step_at=self._channel.first_step_at, artifacts=artifacts)
        finally:  # the task's files on this node (data.cache: disk may be gigabytes), also when training failed
            self._training = False
            self.cleanup()
            self._sweep_node()  # those of tasks killed in this job (a restart's) are gone by now

    def cleanup(self) -> None:
        """Remove this task's folder. The driver asks it of every task it stops (a parameter-server task
        never returns from train), before killing them."""
        if self._ctx is not None:  # a checkpoint still uploading from the folder about to be removed
            self._ctx.checkpoint_uploads.settle(UPLOAD_SETTLE_AT_STOP_S)
        if self._channel is not None:
            self._channel.end_series()  # its gauges stop being set: they end (raytf.metrics)
        if self._scratch is not None:
            tempfile.tempdir = self._tempdir_before
            os.chdir(self._job_root)  # out of the folder being removed
            self._scratch.remove()
            self._scratch = None  # a next job (a sweep's next trial in this process) makes its own

    def stop_at(self, step: int) -> StopAnswer:
        """A drain notice: stop training after optimizer step `step` and checkpoint there (answered while
        train runs, like progress)."""
        if self._channel is None:
            return StopAnswer(False, 0)
        return self._channel.request_stop(step)

    def rescue_point(self, leave_s: float = 0.0) -> int | None:
        """The global step of the state this task kept when a peer died (raytf.actor.rescue); None: none kept.
        A task whose train call still runs (on a busy machine, not yet out of its failed step) is waited for up
        to `leave_s`: answering None then sent the restart back to the last checkpoint, steps lost."""
        deadline = time.monotonic() + leave_s
        while self._ctx is not None and self._ctx.rescue is None and self._training and time.monotonic() < deadline:
            time.sleep(0.02)
        rescue = self._ctx.rescue if self._ctx is not None else None
        return rescue.step if rescue is not None else None

    def upload_rescue(self) -> str:
        """Upload the state kept when a peer died to checkpoint.dir, as its newest checkpoint; returns its path."""
        return self._ctx.rescue.upload()

    def abort_collectives(self) -> None:
        """A peer's actor died: fail this task's collectives now (its step then keeps its state, raytf.actor.rescue)
        rather than when cluster.collective_timeout_s ends them, or never (a peer whose node went silent)."""
        if self._ctx is None:
            return
        import tensorflow as tf
        from tensorflow.python.eager import context

        context.context().abort_collective_ops(tf.errors.UNAVAILABLE, "a peer's actor died")

    def progress(self) -> Progress:
        return self._channel.progress() if self._channel else Progress(updated=time.time())

    def stacks(self) -> dict[str, Any]:
        """Every thread's Python stack and what the training thread is doing (raytf.actor.stacks), for the
        driver's report of a hang (answered while train runs, like progress)."""
        from raytf.actor import stacks

        threads = stacks.snapshot(self._training_thread)
        doing, where, others = stacks.summary(threads)
        return {"doing": doing, "where": where, "others": others, "text": stacks.text(threads)}


# gRPC waits 1 s (its initial reconnect backoff) before it tries a peer again whose server was not up yet at
# the first try, and the ranks of a job start their servers within a few hundred ms of each other: every start
# of a strategy (each attempt, each restart) waited ~1 s for it (1.0-1.1 s -> 0.2-0.3 s at 50 ms, digits on 2
# workers). TensorFlow reads these from TF_GRPC_DEFAULT_OPTIONS whenever it makes a channel. Not
# grpc.min_reconnect_backoff_ms: gRPC takes it as each connection attempt's deadline too (at least 100 ms), and
# under load a handshake between two hosts outlasted that ("connection attempt timed out before receiving SETTINGS
# frame"), which failed the job's first collective (tests/test_multi_host.py, once in CI here).
GRPC_OPTIONS = {"grpc.initial_reconnect_backoff_ms": "50"}


def grpc_default_options(given: str | None) -> str:
    """TF_GRPC_DEFAULT_OPTIONS with raytf's options added to the user's own (`name=value,...`), whose values win."""
    options = [o for o in (given or "").split(",") if o]
    named = {o.split("=", 1)[0] for o in options}
    return ",".join(options + [f"{k}={v}" for k, v in GRPC_OPTIONS.items() if k not in named])


def _configure_process(tf, task: Task, spec) -> None:
    """What TensorFlow takes once per process, before its runtime starts."""
    os.environ["TF_GRPC_DEFAULT_OPTIONS"] = grpc_default_options(os.environ.get("TF_GRPC_DEFAULT_OPTIONS"))
    if spec.train.deterministic:  # before the strategy and the model: every kernel picks its exact path
        tf.config.experimental.enable_op_determinism()
    if spec.cluster.gpu_memory_growth:  # before any GPU is initialised
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    # Size TF's thread pools to the CPUs this actor reserved (as Ray does for OMP_NUM_THREADS), one thread
    # for a fraction of a CPU: several workers on one node otherwise each spawn a pool per core and fight
    # over them. Two inter-op threads at least: a collective op blocks its thread while it waits for peers.
    cluster = spec.cluster
    cpus = {"ps": cluster.cpus_per_ps, "chief": cluster.cpus_per_chief}.get(task.role, cluster.cpus_per_worker)
    intra, inter, spinning = thread_pools(cpus)
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    if not spinning:
        _disable_thread_spinning()


def thread_pools(cpus: float) -> tuple[int, int, bool]:
    """(intra-op threads, inter-op threads, whether idle pool threads may spin) for a task reserving `cpus`.
    A task on a fraction of a CPU shares its core: a pool thread spinning for its next op burns the time its
    neighbours need (three 0.5-CPU processes on 2 cores: 0.96x the CPU per step without spinning,
    benchmarks/bench_fractional_threads.py)."""
    return max(1, int(cpus)), max(2, int(cpus)), cpus >= 1


def _disable_thread_spinning() -> None:
    """Turn off TensorFlow's thread spinning for this process (ConfigProto.experimental.disable_thread_spinning).
    TF 2.21 has no public setter for an eager context's ConfigProto: set it on the context before its runtime
    starts (the strategy's server takes the context's config from it). Best effort: if that private field
    moves, the pools spin as by default."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    if getattr(ctx, "_initialized", True) or not hasattr(ctx, "_config"):
        return
    config = config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    config.experimental.disable_thread_spinning = True
    ctx._config = config


def _name_this_actor(name: str) -> None:
    """Prefix the actor's log lines with its name (raytf:digits:worker-1), as Ray does for the name an actor
    is created with; best effort (a private hook of Ray's: if it moves, the lines go on unprefixed). The
    actor itself is created under this name (raytf.driver.ray_group), planned from the placement."""
    import sys

    from ray._private import ray_constants, worker

    token = f"{ray_constants.LOG_PREFIX_ACTOR_NAME}{name}\n"
    print(token, end="", flush=True)  # the log monitor takes the prefix of later lines from it
    print(token, end="", file=sys.stderr, flush=True)
    try:
        worker.global_worker.core_worker.set_actor_repr_name(name)
    except Exception:
        pass


def _load_note(staging: str, spec) -> str | None:
    """What loading the chief's model.keras takes (raytf.actor.export.load_note); the check never fails a job
    that trained."""
    from raytf.actor import export

    try:
        return export.load_note(staging, legacy=spec.train.keras == "legacy")
    except Exception as exc:  # noqa: BLE001 -- a note, not the job's outcome
        return f"model.keras was not checked for loading ({type(exc).__name__}: {str(exc)[:200]})"


def _collect(folder: str) -> dict[str, bytes]:
    """Files the task wrote (the chief: model, TensorBoard events; a profiled rank: its trace), shipped back
    to the driver: the driver's output.dir need not be on a file system this node can reach."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def _series(task: Task, spec) -> Any:
    """The task's Prometheus series (output.metrics), tagged with the run, its role, rank and node."""
    if not spec.output.metrics:
        return None
    from raytf import backends
    from raytf.metrics import TaskSeries

    role = backends.get(spec.strategy).role_name(task)  # as the run's summary names it: a mirrored rank 0 is chief
    return TaskSeries(spec.name, role, task.rank, task.node_id)
