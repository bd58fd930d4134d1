"""What a strategy backend tells the driver. Pure: no Ray, no TensorFlow."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from raytf.rendezvous import ActorLocation, Task
    from raytf.spec import ClusterSpec, JobSpec


@dataclasses.dataclass(frozen=True)
class RoleSupervision:
    """How the controller treats the tasks of one role while they train.

    awaited: the attempt is done when every awaited task has returned.
    on_failure: "fatal" ends the attempt; "replace" starts a new actor at the task's address and goes on;
    "record" notes the error in the result and goes on.
    watched: no progress from it for failure.hang_timeout_s ends the attempt.
    """

    awaited: bool
    on_failure: Literal["fatal", "replace", "record"]
    watched: bool


class Backend:
    """The driver's half of a strategy. Subclasses fill in the roles and the rules."""

    name: str = ""
    actor_module: str = ""  # the actor's half: raytf.actor.<name>, imported inside the actor only
    default_workers: int = 2  # cluster.workers when the spec does not say (raytf.spec's default; one task's: 1)
    supports_standby: bool = False  # warm processes can take a restarted task's place
    supports_elastic: bool = False  # a restart may go on with fewer workers
    reuses_processes: bool = False  # a sweep's next trial may run in a finished trial's processes
    synchronous_steps: bool = False  # every step waits for every worker (an all-reduce)
    replicated_variables: bool = False  # every replica holds a copy of each variable, kept in sync
    rescues_peers: bool = False  # raytf's loop: a task's death is answered from a survivor's state (raytf.driver.rescue)
    # For a train_fn that calls Keras 3's `.fit()`: why it cannot run under this strategy, and what a loop
    # of the user's own calls to run a step.
    keras3_fit_problem: str = ""
    own_step_call: str = ""
    supervision: dict[str, RoleSupervision] = {}

    def roles(self, spec: "JobSpec") -> list[str]:
        """The TF role of each bundle, in bundle order (the rendezvous relies on it)."""
        raise NotImplementedError

    def bundles(self, spec: "JobSpec") -> list[dict[str, float]]:
        """One placement-group bundle per TF task, in `roles` order."""
        raise NotImplementedError

    def assign(self, locations: "list[ActorLocation]", spec: "JobSpec") -> "list[Task]":
        """Ranks and roles for the started actors, ordered by rank (rank 0 is the chief)."""
        raise NotImplementedError

    def check(self, spec: "JobSpec") -> None:
        """This strategy's spec rules, checked before the general ones (so a key the strategy refuses is
        named as such); a ValueError names the key and the fix."""
        raise NotImplementedError

    def check_batch(self, spec: "JobSpec") -> None:
        """Whether the global batch divides over what one step runs on; checked last."""
        raise NotImplementedError

    def rank_zero_tf_config(self, spec: "JobSpec") -> dict:
        """TF_CONFIG as rank 0 sees it, with placeholder addresses: the driver builds the model as the chief
        would, without starting a server."""
        raise NotImplementedError

    def actor_names(self, spec: "JobSpec", bundle_nodes: dict[int, str]) -> dict[int, str]:
        """bundle index -> the name its actor is created with (raytf:<job>:<role>-<index>), planned from the
        placement alone (bundle index -> node id): ranks and roles do not depend on what actors report."""
        from raytf.rendezvous import placed, task_name

        return {t.bundle_index: task_name(spec.name, t) for t in self.assign(placed(bundle_nodes), spec)}

    def process_key(self, spec: "JobSpec") -> str | None:
        """What a finished job's processes must share with the next job for it to run in them (a sweep's
        next trial, raytf.actor.reuse): the cluster (addresses, threads, devices) and the settings TensorFlow
        takes once per process. None where this strategy cannot re-form its tasks in the same processes."""
        if not self.reuses_processes:
            return None
        return json.dumps({"strategy": spec.strategy, "cluster": spec.cluster.model_dump(mode="json"),
                           "deterministic": spec.train.deterministic, "keras": spec.train.keras}, sort_keys=True)

    def role_name(self, task: "Task") -> str:
        return task.role

    def who(self, ranks: list[int]) -> str:
        """The ranks a message is about ("rank(s) [1]")."""
        return f"rank(s) {ranks}"

    def failed_task(self, task: "Task") -> str:
        """How a failure message names the task it began in ('' where ranks say it all)."""
        return ""

    def reservation_note(self, spec: "JobSpec") -> str:
        """What the bundles are, for the 'reserving' line ('' when they are all alike)."""
        return ""

    def validation_each_epoch(self, spec: "JobSpec") -> bool:
        """Whether each epoch's metrics carry val_* when the report for that epoch arrives."""
        return spec.data is not None and spec.data.validation is not None


def worker_bundle(cluster: "ClusterSpec") -> dict[str, float]:
    """A worker's bundle. Zero-valued resources are left out, and an empty bundle gets a sliver of CPU:
    Ray rejects empty ones."""
    bundle = {k: v for k, v in {"CPU": cluster.cpus_per_worker, "GPU": cluster.gpus_per_worker}.items() if v > 0}
    bundle = bundle or {"CPU": 0.001}
    return {**bundle, **cluster.resources_per_worker}


def nearest_multiples(value: int, divisor: int) -> str:
    below = value - value % divisor
    above = below + divisor
    return f"{below} or {above}" if below > 0 else str(above)
