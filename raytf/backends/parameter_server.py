"""ParameterServerStrategy: one chief running the coordinator, ps tasks holding the variables, workers
running steps asynchronously, and optionally an evaluator side-car."""
from __future__ import annotations

from typing import TYPE_CHECKING

from raytf.backends.base import (
    Backend,
    RoleSupervision,
    nearest_multiples,
    worker_bundle,
)

if TYPE_CHECKING:
    from raytf.rendezvous import ActorLocation, Task
    from raytf.spec import JobSpec


class ParameterServer(Backend):
    name = "parameter_server"
    actor_module = "raytf.actor.parameter_server"
    # TF 2.21's ClusterCoordinator keeps its workers' addresses for life, so a lost worker is replaced at
    # its address rather than the job restarted; the chief and the ps tasks hold the job's state.
    supervision = {
        "chief": RoleSupervision(awaited=True, on_failure="fatal", watched=True),
        "ps": RoleSupervision(awaited=False, on_failure="fatal", watched=False),
        "worker": RoleSupervision(awaited=False, on_failure="replace", watched=False),
        "evaluator": RoleSupervision(awaited=True, on_failure="record", watched=False),
    }

    # Keras 3's fit has no ClusterCoordinator path: TF runs its steps on the chief itself, none on a worker.
    keras3_fit_problem = ("Keras 3's model.fit does not drive ParameterServerStrategy's ClusterCoordinator (every "
                          "step would run on the chief, none on the workers)")
    own_step_call = "ctx.coordinator.schedule"

    def roles(self, spec: "JobSpec") -> list[str]:
        cluster = spec.cluster
        return ["chief"] + ["ps"] * cluster.ps + ["worker"] * cluster.workers + (["evaluator"] if cluster.evaluator else [])

    def bundles(self, spec: "JobSpec") -> list[dict[str, float]]:
        """The chief and ps tasks take CPUs only; workers and the evaluator take what a worker takes."""
        cpus = {"chief": spec.cluster.cpus_per_chief, "ps": spec.cluster.cpus_per_ps}
        return [worker_bundle(spec.cluster) if role in ("worker", "evaluator") else {"CPU": cpus[role] or 0.001}
                for role in self.roles(spec)]

    def assign(self, locations: "list[ActorLocation]", spec: "JobSpec") -> "list[Task]":
        from raytf.rendezvous import assign_roles

        return assign_roles(locations, self.roles(spec))

    def who(self, ranks: list[int]) -> str:
        return "the chief" if ranks == [0] else super().who(ranks)  # the only task watched for progress

    def failed_task(self, task: "Task") -> str:
        return f"{task.role} {task.index} (rank {task.rank}, {task.node_ip}): "

    def reservation_note(self, spec: "JobSpec") -> str:
        roles = self.roles(spec)
        return ", ".join(f"{roles.count(r)} {r}" for r in dict.fromkeys(roles))

    def validation_each_epoch(self, spec: "JobSpec") -> bool:
        # An evaluator's val_* arrive after the epochs they belong to.
        return super().validation_each_epoch(spec) and not spec.cluster.evaluator

    def rank_zero_tf_config(self, spec: "JobSpec") -> dict:
        cluster = spec.cluster
        jobs = {"chief": ["localhost:1"], "ps": ["localhost:2"] * cluster.ps, "worker": ["localhost:3"] * cluster.workers}
        return {"cluster": jobs, "task": {"type": "chief", "index": 0}}

    def check(self, spec: "JobSpec") -> None:
        """What parameter-server jobs support (raytf's loop, a dataset_fn, a train_fn on the chief); each
        refusal names the key and the way out."""
        cluster = spec.cluster
        if cluster.ps < 1:
            raise ValueError(f"cluster.ps: {cluster.ps} under strategy parameter_server; the variables need "
                             f"at least one ps task: set cluster.ps: 1 or more")
        refused = [
            # XLA compiles a function only over variables on its own device, and every variable of a
            # parameter-server job lives on a ps task: TF fails with "Trying to access resource ... located
            # in device /job:ps/... from device /job:worker/..." (tensorflow.org/xla/known_issues).
            (spec.train.jit_compile, "train.jit_compile",
             "set it to false (XLA cannot compile a step whose variables live on the ps tasks, another device)"),
            (spec.failure.elastic is not None, "failure.elastic",
             "remove it: a parameter-server job already goes on when workers die"),
            (spec.train.deterministic, "train.deterministic",
             "remove it: workers update the variables asynchronously, in whatever order they finish (use "
             "strategy: mirrored for a reproducible run)"),
            # ClusterCoordinator gives each step to whichever worker is free, so no worker's share of an
            # epoch is known in advance: "every row once per epoch" cannot be kept.
            (spec.data is not None and spec.data.remainder == "pad", "data.remainder: pad",
             "use remainder: drop (TensorFlow's ClusterCoordinator sends each step to whichever worker is "
             "free, so an epoch is a number of steps, not an exact pass over each worker's rows)"),
            (cluster.communication != "auto" or cluster.collective_timeout_s is not None,
             "cluster.communication" if cluster.communication != "auto" else "cluster.collective_timeout_s",
             "remove it: it sets MultiWorkerMirrored's collectives, and parameter servers have none (gRPC only)"),
            (cluster.gpu_placement == "per_node", "cluster.gpu_placement: per_node",
             "use per_gpu or set gpus_per_worker (per_node would put the chief and every ps task on a node of its own)"),
        ]
        for bad, what, fix in refused:
            if bad:
                raise ValueError(f"{what} is not supported with strategy: parameter_server; {fix}")
        profile = spec.output.profile
        if profile is not None and profile.ranks != [0]:
            raise ValueError(f"output.profile.ranks {profile.ranks}: under parameter_server only the chief "
                             f"(rank 0) runs the loop and is traced; use ranks: [0]")
        if cluster.evaluator and spec.train_fn is not None:
            # The evaluator reads the weights raytf's loop saves beside each checkpoint; a train_fn's
            # checkpoints hold whatever it named, in its own structure.
            raise ValueError("cluster.evaluator evaluates the checkpoints of raytf's loop, not a train_fn's; evaluate "
                             "in the train_fn on the chief (ctx.dataset('validation')), or set evaluator: false")
        if cluster.evaluator and (spec.checkpoint.dir is None or spec.data is None or spec.data.validation is None):
            raise ValueError("cluster.evaluator: the evaluator evaluates the chief's checkpoints on the validation "
                             "data; set checkpoint.dir and data.validation, or evaluator: false")

    def check_batch(self, spec: "JobSpec") -> None:
        replicas, batch = spec.cluster.replicas_per_worker, spec.train.global_batch_size
        if batch % replicas:
            raise ValueError(f"train.global_batch_size {batch} (the batch of one step, run by one worker) is not "
                             f"divisible by the {replicas} GPUs of a worker; use {nearest_multiples(batch, replicas)}")


PARAMETER_SERVER = ParameterServer()
