"""An in-memory cluster for stepping the controller without Ray or TensorFlow: a fake clock, and
`FakeResources` / `FakeGroup` implementing raytf.driver.group's interfaces, whose ranks follow scripts
(train for a while and return, fail, hang) on the fake clock."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

from raytf.driver.group import Finished, TaskError
from raytf.errors import PlacementTimeout, PortTaken, WorkerStartupError
from raytf.protocol import CheckpointSaved, CodePackage, DrainStop, Outcome, Progress, StopAnswer, TaskCode
from raytf.rendezvous import ActorLocation

# What a run given it packs no job folder (the fakes start no process that would unpack one).
NO_CODE = TaskCode(CodePackage("no-code", None))


class FakeClock:
    def __init__(self, start: float = 1_000_000.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


@dataclasses.dataclass
class Script:
    """What one task does once it trains, in seconds after its train call: return at `finish_after`
    (None: never, as a parameter-server ps or worker serves until stopped), fail at `fail_after` with
    `error`, or stop making progress from `hang_after`."""

    finish_after: float | None = 5.0
    fail_after: float | None = None
    error: TaskError | None = None
    hang_after: float | None = None
    steps_per_s: float = 10.0
    checkpoint_s: float | None = None  # how long its last checkpoint took, as its progress says
    says_steps: bool = True  # False: a train_fn that reports no step (a tf.keras fit), only epochs
    cpu_share: float = 1.0  # of one core, while it runs (not once it hangs)
    epoch_s: float | None = None  # an epoch's metrics in its progress every this many seconds
    work_per_s: float = 0.0  # a parameter-server chief's train_fn: functions its workers finished, per second
    outcome: dict[str, Any] = dataclasses.field(default_factory=dict)  # Outcome fields to set
    rescue_step: int | None = None  # the step whose state it keeps when a peer dies (raytf.actor.rescue)


def actor_died() -> TaskError:
    return TaskError("ActorDiedError", "The actor died unexpectedly", True, "actor died (killed)")


def user_error(message: str = "boom", where: str | None = None) -> TaskError:
    said = f"ValueError: {message}"
    return TaskError("ValueError", message, False, f"{where}: {said}" if where else said,
                     f'Traceback (most recent call last):\n  File "{where}"\n{said}\n' if where else None)


def collective_error() -> TaskError:
    return TaskError("UnavailableError", "Collective ops is aborted by: peer down", False,
                     "UnavailableError: Collective ops is aborted by: peer down")


def checkpoint_corrupt(path: str) -> TaskError:
    return TaskError("CheckpointCorrupt", f"checkpoint {path} cannot be restored", False,
                     f"CheckpointCorrupt: checkpoint {path} cannot be restored")


CHECKPOINT_S = 0.5  # how long a fake checkpoint-now takes


class _Handle:
    _ids = itertools.count()

    def __init__(self, rank: int, script: Script, started: float):
        self.id, self.rank, self.script, self.started = next(self._ids), rank, script, started
        self.stop_step: int | None = None  # a drain notice's common step

    def step_at(self, now: float) -> int:
        return int((now - self.started) * self.script.steps_per_s)

    def event(self) -> tuple[float, str] | None:
        """(when, 'finish' | 'fail' | 'stopped') of this task's end, if it ends."""
        s = self.script
        if self.stop_step is not None:  # reaches the step, then checkpoints for CHECKPOINT_S
            stopped = self.started + self.stop_step / s.steps_per_s + CHECKPOINT_S
            if s.fail_after is None or stopped < self.started + s.fail_after:
                return stopped, "stopped"
        if s.fail_after is not None:
            return self.started + s.fail_after, "fail"
        if s.finish_after is not None:
            return self.started + s.finish_after, "finish"
        return None

    def __hash__(self):
        return self.id

    def __eq__(self, other):
        return self is other


class FakeGroup:
    def __init__(self, world: "FakeResources", bundles: list[dict[str, float]], names=None):
        self.world, self.bundles, self.clock = world, bundles, world.clock
        self.plan_names = names
        self.names: dict[int, str] = {}  # bundle index -> the name its actor was created with
        self.attempt = len(world.groups) + 1
        self.tasks = []
        self.handles: list[_Handle] = []
        self.returned: set[_Handle] = set()
        self.stopped = False
        self.fail_setup: str | None = None  # a kept group's processes that do not start again

    def start(self, timeout_s: float) -> list[ActorLocation]:
        # bundles alternate over the nodes that are not draining (Ray places nothing new on those)
        nodes = [n for n in self.world.nodes if n not in self.world.draining()]
        node_of = {i: nodes[i % len(nodes)] for i in range(len(self.bundles))}
        if self.plan_names is not None:
            self.names = self.plan_names(node_of)
        return [ActorLocation(bundle_index=i, node_id=node, node_ip=f"10.0.0.{self.world.nodes.index(node) + 1}",
                            port=4000 + i) for i, node in node_of.items()]

    def setup(self, tasks, payload, timeout_s: float):
        self.tasks = tasks
        if self.fail_setup:
            raise WorkerStartupError(f"workers failed to start TensorFlow: rank 0: {self.fail_setup}")
        if self.world.port_taken_times > 0:
            self.world.port_taken_times -= 1
            raise PortTaken(f"rank 1: port {tasks[1].port} on {tasks[1].node_ip} was taken")
        return []

    def train(self, payload) -> list[_Handle]:
        self.world.payloads.append(payload)
        now = self.clock.now()
        self.handles = [_Handle(t.rank, self.world.script(self.attempt, t), now) for t in self.tasks]
        return list(self.handles)

    def wait(self, handles: list[_Handle], timeout_s: float) -> list[Finished]:
        now = self.clock.now()
        ends = [(h.event(), h) for h in handles if h not in self.returned]
        due = [(when, kind, h) for (e, h) in ends if e is not None for when, kind in [e] if when <= now + timeout_s]
        if not due:
            self.clock.advance(timeout_s)
            return []
        first = min(when for when, _, _ in due)
        self.clock.advance(first - now)
        out = []
        for when, kind, h in due:
            if when <= first:
                self.returned.add(h)
                if kind == "fail":
                    out.append(Finished(h, error=h.script.error))
                elif kind == "stopped":
                    if h.rank == 0 and self.world.on_checkpoint is not None:
                        self.world.on_checkpoint(h.stop_step)
                    out.append(Finished(h, outcome=Outcome(steps=h.stop_step, preempted=DrainStop(
                        h.stop_step, CheckpointSaved(h.stop_step, CHECKPOINT_S)))))
                else:
                    out.append(Finished(h, outcome=self._outcome(h)))
        return out

    def _outcome(self, h: _Handle) -> Outcome:
        steps = int(h.script.finish_after * h.script.steps_per_s)
        return dataclasses.replace(Outcome(
            history=[{"epoch": 1, "loss": 0.5, "seconds": 1.0, "step": steps}], weights_digest="same", steps=steps,
            steps_run=steps, first_step_at=h.started + 0.1, finished_at=h.started + h.script.finish_after),
            **h.script.outcome)

    def progress(self, timeout_s: float) -> list[Progress | None]:
        now = self.clock.now()
        out = []
        for h in sorted(self.handles, key=lambda h: h.rank):
            if h in self.returned and h.script.fail_after is not None:
                out.append(None)  # dead
                continue
            running = now - h.started
            if h.script.hang_after is not None:
                running = min(running, h.script.hang_after)
            epochs = tuple({"epoch": e, "loss": 1.0 / e, "seconds": h.script.epoch_s}
                           for e in range(1, int(running // h.script.epoch_s) + 1)) if h.script.epoch_s else ()
            step = int(running * h.script.steps_per_s) if h.script.says_steps else 0
            out.append(Progress(phase="train", global_step=step, epochs=epochs, cpu_s=running * h.script.cpu_share,
                                work_done=int(running * h.script.work_per_s), updated=now,
                                steps_per_s=h.script.steps_per_s, checkpoint_s=h.script.checkpoint_s))
        return out

    def stacks(self, timeout_s: float) -> list[dict | None]:
        """A hung rank is in the user's code, the others wait in TensorFlow's step (their collective)."""
        now = self.clock.now()
        out = []
        for h in sorted(self.handles, key=lambda h: h.rank):
            stuck = h.script.hang_after is not None and now - h.started >= h.script.hang_after
            out.append({"doing": "user code" if stuck else "a TensorFlow step or collective",
                        "where": "tmodel.py:7 in stall" if stuck else "steps.py:1 in step", "others": [],
                        "text": f"Thread MainThread (training):\n  rank {h.rank}\n"})
        return out

    def stop_at(self, ranks: list[int], step: int, timeout_s: float) -> list[StopAnswer | None]:
        self.world.stop_requests.append((list(ranks), step))
        out = []
        for h in sorted(self.handles, key=lambda h: h.rank):
            if h.rank in ranks:
                done = h.step_at(self.clock.now())
                accepted = step > done and h.rank not in self.world.refuse_stop
                if accepted:
                    h.stop_step = step
                out.append(StopAnswer(accepted, done))
        return out

    def abort_collectives(self, ranks: list[int]) -> None:
        self.world.aborted.append(list(ranks))

    def rescue_points(self, ranks: list[int], timeout_s: float, leave_s: float = 0.0) -> list[int | None]:
        by_rank = {h.rank: h for h in self.handles}
        return [by_rank[r].script.rescue_step if r in by_rank else None for r in ranks]

    def upload_rescue(self, rank: int, timeout_s: float) -> str | None:
        step = next(h.script.rescue_step for h in self.handles if h.rank == rank)
        self.world.rescue_uploads.append((rank, step))
        if self.world.on_checkpoint is not None:
            self.world.on_checkpoint(step)
        return f"ckpt-{step:012d}"

    def replace(self, task, payload, timeout_s: float) -> _Handle:
        handle = _Handle(task.rank, self.world.replacement(task), self.clock.now())
        self.world.replaced.append(task.rank)
        self.handles = [handle if h.rank == task.rank else h for h in self.handles]
        return handle

    def stop(self) -> None:
        self.stopped = True


class FakeResources:
    """`capacity`: how many bundles the cluster holds for each reservation (an int for all, or a function
    of the reservation's number); `script(attempt, task)`: what each task does."""

    def __init__(self, clock: FakeClock, script: Callable[[int, Any], Script],
                 capacity: int | Callable[[int], int] = 1000, port_taken_times: int = 0,
                 replacement: Callable[[Any], Script] | None = None, nodes: int = 2):
        self.clock, self.script, self.port_taken_times = clock, script, port_taken_times
        self.capacity = capacity if callable(capacity) else (lambda n: capacity)
        self.replacement = replacement or (lambda task: Script(finish_after=None))
        self.groups: list[FakeGroup] = []
        self.reservations: list[int] = []  # bundles asked for, per reservation
        self.released: list[Any] = []
        self.payloads: list[Any] = []
        self.replaced: list[int] = []
        self.pg_alive = True
        self.nodes = ["node-0", "node-1", "node-2"][:nodes]
        self.drains: list[tuple[float, str, float | None]] = []  # (from when, node id, deadline) as Ray would say
        self.stop_requests: list[tuple[list[int], int]] = []
        self.room_from: float | None = None  # from when can_place says the missing bundles fit again
        self.probes: list[int] = []  # bundles asked for, per can_place
        self.refuse_stop: set[int] = set()  # ranks that answer a stop request as already past the step
        self.on_checkpoint: Callable[[int], None] | None = None  # the chief's checkpoint-now, at this step
        self.aborted: list[list[int]] = []  # the ranks whose collectives were failed, per death (raytf.driver.rescue)
        self.rescue_uploads: list[tuple[int, int]] = []  # (rank, step) of each survivor's state uploaded
        self.keep_processes = False  # a sweep's trial process (raytf.actor.reuse): a succeeded group is kept
        self.kept: tuple | None = None
        self.kept_fails_setup: str | None = None
        self.kept_asked: list = []  # the key of each take_kept
        self.standby_filled: list[int] = []  # the task count of each fill_standby (one per armed attempt)

    def reserve(self, bundles, strategy: str, timeout_s: float, name: str):
        self.reservations.append(len(bundles))
        if len(bundles) > self.capacity(len(self.reservations)):
            self.clock.advance(timeout_s)
            raise PlacementTimeout(f"placement group not ready after {timeout_s:g}s: asked for {len(bundles)} bundles")
        return f"pg-{len(self.reservations)}"

    def ready_again(self, pg, timeout_s: float) -> bool:
        return self.pg_alive

    def release(self, pg) -> None:
        self.released.append(pg)

    def new_group(self, pg, bundles, code, standby, names=None) -> FakeGroup:
        group = FakeGroup(self, bundles, names)
        self.groups.append(group)
        return group

    def fill_standby(self, pg, code, tasks, job="") -> None:
        self.standby_filled.append(len(tasks))

    def take_standby(self, pg, count: int) -> dict:
        return {}

    def release_standby(self) -> None:
        pass

    def keep(self, group, tasks, key) -> bool:
        if not self.keep_processes or key is None:
            return False
        self.kept = (group, list(tasks), key)
        return True

    def take_kept(self, pg, key, code, count):
        kept, self.kept = self.kept, None
        self.kept_asked.append(key)
        if kept is not None and key is not None and kept[2] == key and len(kept[1]) == count:
            kept[0].fail_setup = self.kept_fails_setup
            return kept[0], kept[1]
        if kept is not None:
            kept[0].stop()
        return None

    def can_place(self, bundles, strategy: str, timeout_s: float) -> bool:
        self.probes.append(len(bundles))
        return self.room_from is not None and self.clock.now() >= self.room_from

    def draining(self) -> dict[str, float | None]:
        return {node: deadline for since, node, deadline in self.drains if since <= self.clock.now()}
