"""The controller's interfaces on Ray: one TaskActor per placement-group bundle (RayWorkerGroup), and
placement groups with warm standby actors (RayResources)."""
from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
import uuid
from typing import Any, Callable

import ray
from ray.exceptions import ActorAlreadyExistsError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytf.protocol import Progress, StopAnswer, TaskCode, WorkerPayload
from raytf.actor.raised import summary
from raytf.actor.task_actor import TaskActor
from raytf.driver import placement
from raytf.driver.group import Finished, TaskError
from raytf.errors import PortTaken, TaskException, WorkerStartupError
from raytf.rendezvous import ActorLocation, Task, task_name, tf_config, tf_configs

_RemoteTaskActor = ray.remote(TaskActor)


def root_cause(exc: BaseException) -> BaseException:
    """The user's exception inside Ray's wrappers, where there is one."""
    if isinstance(exc, RayTaskError):
        cause = exc.as_instanceof_cause()
        inner = getattr(exc, "cause", None)
        return inner if isinstance(inner, BaseException) else cause
    return exc


def describe(exc: BaseException) -> str:
    """One line: the user's file:line where there is one, the exception's type and what it says."""
    exc = root_cause(exc)
    if isinstance(exc, RayActorError):
        return f"actor died ({str(exc).splitlines()[0][:300]})"
    if isinstance(exc, TaskException):
        name, line = exc.type_name, summary(exc.message)
    else:
        name, line = type(exc).__name__, summary(str(exc))
    said = line if line.startswith(f"{name}: ") else f"{name}: {line}".strip()
    where = getattr(exc, "where", None)
    return f"{where}: {said}" if where else said


def task_error(exc: BaseException) -> TaskError:
    cause = root_cause(exc)
    if isinstance(cause, TaskException):
        return TaskError(cause.type_name, cause.message, False, describe(exc), cause.traceback)
    return TaskError(type(cause).__name__, str(cause), isinstance(cause, RayActorError), describe(exc),
                     getattr(cause, "traceback", None))


def create_actor(pg, index: int, bundle: dict[str, float], code: TaskCode, port: int = 0,
                 name: str | None = None, namespace: str | None = None):
    """A TaskActor in bundle `index`, given the job's code (no Ray runtime env: raytf.driver.packaging.pack_code);
    an empty `bundle` makes a warm standby that takes no resources.
    `name` shows in `ray list actors` and the dashboard; names are unique within a namespace, so each
    group of actors gets a namespace of its own (a restart, a sweep's trials and a replacement reuse names)."""
    options = dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_concurrency=2,
                   max_restarts=0,
                   scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                        placement_group_bundle_index=index))
    if name is not None:
        options.update(name=name, namespace=namespace or new_namespace())
    return _RemoteTaskActor.options(**options).remote(index, port, code)


def new_namespace() -> str:
    return f"raytf-{uuid.uuid4().hex[:12]}"


def bundle_nodes(pg) -> dict[int, str]:
    """bundle index -> node id, once the placement group is ready."""
    return {int(i): node for i, node in ray.util.placement_group_table(pg)["bundles_to_node_id"].items()}


CLEANUP_TIMEOUT_S = 2.0  # for the tasks being stopped to remove their files, before they are killed
NODE_PROBE_S = 5.0  # a node whose raylet does not accept a connection in this long is taken for gone


def unresponsive(nodes: set[str], timeout_s: float) -> set[str]:
    """The nodes (ids) whose raylet does not accept a TCP connection within timeout_s: a host that dropped off
    the network (the connection times out) or whose raylet died (refused). A connection, not a task: a task
    would wait ~0.9 s for a new worker process on each node, on every restart."""
    where = {n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in ray.nodes()}

    def answers(node: str) -> bool:
        if node not in where:
            return False
        try:
            socket.create_connection(where[node], timeout=timeout_s).close()
            return True
        except OSError:
            return False

    ordered = sorted(nodes)
    with concurrent.futures.ThreadPoolExecutor(max(1, len(ordered))) as pool:
        return {node for node, ok in zip(ordered, pool.map(answers, ordered)) if not ok}


def kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass


class RayWorkerGroup:
    def __init__(self, pg, bundles: list[dict[str, float]], code: TaskCode,
                 standby: dict[int, tuple[Any, tuple, str | None]] | None = None,
                 names: Callable[[dict[int, str]], dict[int, str]] | None = None):
        """standby: bundle index -> (warm actor, GPU ids, CUDA_VISIBLE_DEVICES) to use instead of a new actor.
        names: bundle index -> node id  to  bundle index -> actor name (the backend's plan of ranks)."""
        self.pg, self.bundles, self.code = pg, bundles, code
        self.standby = dict(standby or {})
        self._plan_names = names
        self._names: dict[int, str] = {}
        self._namespace = new_namespace()
        self.actors: list[Any] = []  # by bundle index
        self.tasks: list[Task] = []  # by rank
        self._by_rank: list[Any] = []
        self._lock = threading.Lock()
        self._stopped = False

    def start(self, timeout_s: float) -> list[ActorLocation]:
        """Create one actor per bundle, named after the task it will play, and collect where each is."""
        if self._plan_names is not None:
            self._names = self._plan_names(bundle_nodes(self.pg))
        locations = []
        for index in range(len(self.bundles)):
            if index in self.standby:
                actor, gpu_ids, visible = self.standby.pop(index)
                locations.append(actor.adopt.remote(gpu_ids, visible))
            else:
                actor = self._create(index)
                locations.append(actor.location.remote())
            self.actors.append(actor)
        return self._get(locations, timeout_s, "report in", [f"bundle {i}" for i in range(len(self.actors))])

    def _create(self, index: int, port: int = 0):
        name = self._names.get(index)
        try:
            return create_actor(self.pg, index, self.bundles[index], self.code, port, name, self._namespace)
        except ActorAlreadyExistsError:  # still held by the actor this one replaces, dead but not yet freed
            name = f"{name}.{uuid.uuid4().hex[:4]}" if name else None
            return create_actor(self.pg, index, self.bundles[index], self.code, port, name, self._namespace)

    def setup(self, tasks: list[Task], payload: WorkerPayload, timeout_s: float) -> list[dict[str, Any]]:
        self.tasks = tasks
        self._by_rank = [self.actors[t.bundle_index] for t in tasks]
        refs = [a.setup.remote(t, config, len(tasks), payload)
                for a, t, config in zip(self._by_rank, tasks, tf_configs(tasks))]
        return self._get(refs, timeout_s, "start TensorFlow", [f"rank {t.rank}" for t in tasks])

    def replace(self, task: Task, payload: WorkerPayload, timeout_s: float) -> ray.ObjectRef:
        """A new actor for a dead task, in its bundle and at its port, set up as the task was; returns its
        train ref. Fails when the bundle has moved to another node (the address would change)."""
        with self._lock:  # a replacement racing the end of the attempt must not outlive it
            if self._stopped:
                raise WorkerStartupError("the attempt has ended")
            actor = self._create(task.bundle_index, port=task.port)
            self.actors[task.bundle_index] = actor  # stop() kills it whatever happens next
        try:
            where = self._get([actor.location.remote()], timeout_s, "report in", [f"rank {task.rank}"])[0]
            if where.node_ip != task.node_ip:
                raise WorkerStartupError(f"its bundle moved from {task.node_ip} to {where.node_ip}")
            self._get([actor.setup.remote(task, tf_config(self.tasks, task), len(self.tasks), payload)], timeout_s,
                      "start TensorFlow", [f"rank {task.rank}"])
        except WorkerStartupError:
            kill(actor)
            raise
        except Exception as exc:  # the actor died meanwhile, or Ray failed: one line, as for start-up
            kill(actor)
            raise WorkerStartupError(describe(exc)) from None
        self._by_rank[task.rank] = actor
        return actor.train.remote(payload)

    def train(self, payload: WorkerPayload) -> list[ray.ObjectRef]:
        """Each task's training call, named after its job, role and index (raytf:digits:worker-1) in
        `ray list tasks` and the dashboard."""
        return [a.train.options(name=task_name(payload.spec.name, t)).remote(payload)
                for a, t in zip(self._by_rank, self.tasks)]

    def wait(self, handles: list[ray.ObjectRef], timeout_s: float) -> list[Finished]:
        """Returns as soon as one is done (with any others done by then), or after timeout_s with none."""
        if not handles:
            return []
        done, rest = ray.wait(list(handles), num_returns=1, timeout=timeout_s)
        if not done:
            return []
        if rest:
            done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        out = []
        for ref in done:
            try:
                out.append(Finished(ref, outcome=ray.get(ref)))
            except Exception as exc:
                out.append(Finished(ref, error=task_error(exc)))
        return out

    def progress(self, timeout_s: float) -> list[Progress | None]:
        """Each rank's latest progress; None for a rank that did not answer in time."""
        return answers([a.progress.remote() for a in self._by_rank], timeout_s)

    def stacks(self, timeout_s: float) -> list[dict | None]:
        """Each rank's threads' stacks and what it was doing; None for a rank that did not answer in time."""
        return answers([a.stacks.remote() for a in self._by_rank], timeout_s)

    def stop_at(self, ranks: list[int], step: int, timeout_s: float) -> list[StopAnswer | None]:
        return answers([self._by_rank[r].stop_at.remote(step) for r in ranks], timeout_s)

    def abort_collectives(self, ranks: list[int]) -> None:
        """A peer died: fail these ranks' collectives now (not answered: they may be busy; the wait is for
        their train calls)."""
        for rank in ranks:
            try:
                self._by_rank[rank].abort_collectives.remote()
            except Exception:  # already gone
                pass

    def rescue_points(self, ranks: list[int], timeout_s: float, leave_s: float = 0.0) -> list[int | None]:
        """The step of the state each rank kept when a peer died; None: none kept, or no answer in time. A rank
        still on its way out of its failed step is waited for up to `leave_s` more."""
        return answers([self._by_rank[r].rescue_point.remote(leave_s) for r in ranks], timeout_s + leave_s)

    def upload_rescue(self, rank: int, timeout_s: float) -> str | None:
        """Rank `rank` uploads the state it kept to checkpoint.dir; its path, or None (failed, or not in time)."""
        return answers([self._by_rank[rank].upload_rescue.remote()], timeout_s)[0]

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            actors, self.actors, self._by_rank = self.actors, [], []
        # Each task first removes its files on its node (a killed one cannot; a later task's sweep would),
        # briefly: a dead or wedged actor does not hold up the teardown.
        refs = []
        for actor in actors:
            try:
                refs.append(actor.cleanup.remote())
            except Exception:  # already gone
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=CLEANUP_TIMEOUT_S)
        for actor in actors:
            kill(actor)

    @staticmethod
    def _get(refs: list, timeout_s: float, what: str, names: list[str]) -> list:
        """All results, in order; the first error ends the wait (peers may be blocked on the failed one)."""
        deadline = time.monotonic() + timeout_s
        name_of = dict(zip(refs, names))
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise WorkerStartupError(f"workers failed to {what}: {', '.join(name_of[r] for r in pending)} "
                                         f"did not answer within {timeout_s:g}s")
            try:
                ray.get(done[0])
            except Exception as exc:
                cause = root_cause(exc)
                if isinstance(cause, PortTaken):
                    raise cause from None
                error = WorkerStartupError(f"workers failed to {what}: {name_of[done[0]]}: {describe(exc)}")
                error.traceback = getattr(cause, "traceback", None)
                raise error from None
        return ray.get(refs)


def answers(refs: list, timeout_s: float) -> list:
    """The results of calls made to several actors at once, in order: None for one that did not answer within
    `timeout_s` (all wait together) or failed."""
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref) if ref in ready else None)
        except Exception:
            out.append(None)
    return out


# In a sweep's trial process (a Tune actor Tune reuses for the next trial on the same placement group): the
# last trial's actors, set up again for the next one when its key matches (raytf.actor.reuse). At most one.
_kept: dict[str, tuple] = {}


def drop_kept() -> None:
    """Stop the group kept in this process, if any (a trial that ends badly after its job succeeded)."""
    kept = _kept.pop("group", None)
    if kept is not None:
        kept[3].stop()


class RayResources:
    """Placement groups through Ray, and warm standby actors: one per bundle, started once an attempt's
    actors are set up (or once a restarted attempt trains again), each with TensorFlow imported and no
    resources of its own. Most of a restart is new processes importing TensorFlow; a restart promotes
    these instead (TF 2.21 re-forms a collective group inside a process that was in one only over the same
    cluster, so a failed attempt's survivors are not reused; a sweep keeps only the processes of a job that
    ended well: keep, take_kept)."""

    def __init__(self, group_cls=RayWorkerGroup, standby_enabled: bool = False, standby_check_s: float = 1.0,
                 keep_processes: bool = False):
        self.group_cls, self.standby_enabled, self.standby_check_s = group_cls, standby_enabled, standby_check_s
        self.keep_processes = keep_processes
        self._standby_pg = None
        self._standby: dict[int, tuple[Any, tuple, str | None]] = {}

    def reserve(self, bundles, strategy: str, timeout_s: float, name: str):
        return placement.reserve(bundles, strategy, timeout_s, name=name)

    def can_place(self, bundles, strategy: str, timeout_s: float) -> bool:
        """Whether these bundles can be placed now: a probe placement group, removed at once."""
        pg = ray.util.placement_group(bundles, strategy=strategy.upper())
        try:
            return bool(ray.wait([pg.ready()], timeout=timeout_s)[0])
        finally:
            ray.util.remove_placement_group(pg)

    def ready_again(self, pg, timeout_s: float) -> bool:
        """Ready, with every bundle on a node that answers. A node that died or dropped off the network is
        still "alive" to Ray until its health checks run out (~30 s), and the group's bundle stays on it:
        an actor created there dies at once, a wasted restart. So each node of the group's raylet is asked for a
        connection (`unresponsive`); while one does not accept it in NODE_PROBE_S, the group waits (and asks again:
        a node only busy answers later) until Ray declares it dead and moves the bundle, or the deadline passes
        (False, and the caller reserves anew)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))[0]:
                return False
            table = ray.util.placement_group_table(pg)
            nodes = set(table["bundles_to_node_id"].values())
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            if table["state"] == "CREATED" and nodes <= alive and \
                    not unresponsive(nodes, min(NODE_PROBE_S, max(0.1, deadline - time.monotonic()))):
                return True
            time.sleep(0.5)
        return False

    def release(self, pg) -> None:
        placement.release(pg)

    def new_group(self, pg, bundles, code, standby, names=None):
        return self.group_cls(pg, bundles, code, standby=standby or None, names=names)

    def keep(self, group: RayWorkerGroup, tasks: list[Task], key: str | None) -> bool:
        """Hold a finished job's actors (each has removed its files) for the next job in this process, on the
        same placement group with the same key; False (and nothing held) where processes are not kept."""
        if not self.keep_processes or key is None or group is None:
            return False
        drop_kept()
        _kept["group"] = (group.pg.id, key, group.code, group, list(tasks))
        return True

    def take_kept(self, pg, key: str | None, code: TaskCode, count: int) -> tuple[RayWorkerGroup, list[Task]] | None:
        """The kept group and its tasks (their addresses, so TF_CONFIG is the same), if it matches this job;
        otherwise it is stopped, so that its actors free their bundles for this job's."""
        kept = _kept.pop("group", None)
        if kept is None:
            return None
        pg_id, kept_key, kept_code, group, tasks = kept
        if key is not None and key == kept_key and pg is not None and pg.id == pg_id and kept_code == code \
                and len(tasks) == count:
            return group, tasks
        group.stop()
        return None

    def fill_standby(self, pg, code: TaskCode, tasks: list[Task], job: str = "") -> None:
        """One warm process per task, named raytf:<job>:standby-<rank> (it keeps that name once promoted)."""
        if not self.standby_enabled or self._standby:
            return
        self._standby_pg = pg
        namespace = new_namespace()
        for t in tasks:
            actor = create_actor(pg, t.bundle_index, {}, code, name=f"raytf:{job}:standby-{t.rank}", namespace=namespace)
            self._standby[t.bundle_index] = (actor, t.gpu_ids, t.cuda_visible_devices)

    def take_standby(self, pg, count: int) -> dict[int, tuple[Any, tuple, str | None]]:
        """The live standbys of bundles 0..count-1 of this placement group; the others are let go."""
        if not self._standby:
            return {}
        actors, self._standby = self._standby, {}
        usable = {i: a for i, a in actors.items()
                  if i < count and self._standby_pg is not None and pg.id == self._standby_pg.id}
        refs = {i: a[0].location.remote() for i, a in usable.items()}
        ready = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.standby_check_s)[0] if refs else []
        alive = {}
        for i, ref in refs.items():
            if ref in ready:
                try:
                    ray.get(ref)
                    alive[i] = usable[i]
                except Exception:  # died with its node
                    pass
        for i, (actor, _, _) in actors.items():
            if i not in alive:
                kill(actor)
        return alive

    def release_standby(self) -> None:
        for actor, _, _ in self._standby.values():
            kill(actor)
        self._standby = {}

    def draining(self) -> dict[str, float | None]:
        """The nodes Ray's GCS marks as draining (`ray drain-node`, the autoscaler, a cloud's preemption
        notice), each with its deadline. Ray keeps this behind a private accessor; should it move, raytf
        sees no drains (and a preempted node is handled as a lost one)."""
        try:
            from ray._private.state import state

            nodes = state.get_draining_nodes()
        except Exception:
            return {}
        return {node: (deadline_ms / 1000.0 if deadline_ms else None) for node, deadline_ms in nodes.items()}
