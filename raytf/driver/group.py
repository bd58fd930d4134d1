"""The actors of one attempt, and the cluster resources they run in, as the controller sees them: the
interfaces it steps over. raytf.driver.ray_group implements them on Ray (one TaskActor per placement-group
bundle); tests/fakes.py has an in-memory pair. No Ray here, so the controller can be stepped without it.

Every call that waits takes a deadline; a deadline passed is an error that names the ranks or bundles
that did not answer, never a hang.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from raytf.protocol import Outcome, Progress, StopAnswer, TaskCode, WorkerPayload
    from raytf.rendezvous import ActorLocation, Task


@dataclasses.dataclass(frozen=True)
class TaskError:
    """Why a task's train call failed, as plain data: the root cause's type and message, whether the
    actor died, and one line for people."""

    type_name: str
    message: str
    actor_died: bool
    described: str
    traceback: str | None = None  # the task's, where it raised (not when its actor died)


@dataclasses.dataclass(frozen=True)
class Finished:
    """A train call that returned: its outcome, or its error."""

    handle: Any
    outcome: "Outcome | None" = None
    error: TaskError | None = None


class WorkerGroup(Protocol):
    """The actors of one attempt, one per bundle."""

    def start(self, timeout_s: float) -> list["ActorLocation"]: ...
    def setup(self, tasks: "list[Task]", payload: "WorkerPayload", timeout_s: float) -> Any: ...
    def train(self, payload: "WorkerPayload") -> list[Any]: ...  # one handle per rank
    def wait(self, handles: list[Any], timeout_s: float) -> list[Finished]: ...  # those done, maybe none
    def progress(self, timeout_s: float) -> "list[Progress | None]": ...  # by rank; None: no answer
    # by rank: {doing, where, others, text} (raytf.actor.stacks), None where a rank did not answer in time
    def stacks(self, timeout_s: float) -> "list[dict | None]": ...
    def replace(self, task: "Task", payload: "WorkerPayload", timeout_s: float) -> Any: ...  # a new handle
    # A drain notice: these ranks stop after optimizer step `step` and checkpoint there. In the order of
    # `ranks`, each one's answer, or None where it did not answer in time.
    def stop_at(self, ranks: list[int], step: int, timeout_s: float) -> "list[StopAnswer | None]": ...
    # A task died (raytf.driver.rescue): fail these ranks' collectives now; the step of the state each kept on
    # the way out (None: none, or no answer); one rank uploads its state as the newest checkpoint (None: failed).
    def abort_collectives(self, ranks: list[int]) -> None: ...
    def rescue_points(self, ranks: list[int], timeout_s: float, leave_s: float = 0.0) -> "list[int | None]": ...
    def upload_rescue(self, rank: int, timeout_s: float) -> "str | None": ...
    def stop(self) -> None: ...


class Resources(Protocol):
    """Placement groups and warm standby processes."""

    def reserve(self, bundles: list[dict[str, float]], strategy: str, timeout_s: float, name: str) -> Any: ...
    def ready_again(self, pg: Any, timeout_s: float) -> bool: ...
    def release(self, pg: Any) -> None: ...
    def new_group(self, pg: Any, bundles: list[dict[str, float]], code: "TaskCode", standby: dict[int, Any],
                  names: "Callable[[dict[int, str]], dict[int, str]] | None" = None) -> WorkerGroup: ...
    # names: from bundle index -> node id, bundle index -> the name its actor is created with
    def fill_standby(self, pg: Any, code: "TaskCode", tasks: "list[Task]", job: str = "") -> None: ...
    def take_standby(self, pg: Any, count: int) -> dict[int, Any]: ...
    def release_standby(self) -> None: ...
    # A sweep's next trial in a finished one's processes (raytf.actor.reuse): keep a succeeded attempt's
    # group (False: not kept, stop it), and take it back when the next job's key, group and code match
    # (None: new actors; a kept group that does not match is stopped).
    def keep(self, group: WorkerGroup, tasks: "list[Task]", key: str | None) -> bool: ...
    def take_kept(self, pg: Any, key: str | None, code: "TaskCode", count: int) -> "tuple[WorkerGroup, list[Task]] | None": ...
    def draining(self) -> dict[str, float | None]: ...  # node id -> its deadline (epoch s; None: none given)
    def can_place(self, bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> bool: ...  # room now?


