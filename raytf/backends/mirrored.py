"""MultiWorkerMirroredStrategy: N identical workers, rank 0 the chief, every step a collective."""
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

# cluster keys that only a parameter-server job has
PS_KEYS = ("ps", "cpus_per_ps", "cpus_per_chief", "evaluator", "variable_partitioner")


class Mirrored(Backend):
    name = "mirrored"
    actor_module = "raytf.actor.mirrored"
    supports_standby = True
    supports_elastic = True
    reuses_processes = True  # TF re-forms a collective group in its processes with the same cluster (raytf.actor.reuse)
    synchronous_steps = True
    replicated_variables = True
    rescues_peers = True  # every worker holds the whole state: a survivor's is the restart's (raytf.actor.rescue)
    keras3_fit_problem = "Keras 3's model.fit fails under MultiWorkerMirroredStrategy on TensorFlow 2.21"
    own_step_call = "strategy.run"
    # A worker that dies leaves its peers hanging in a collective: any failure ends the attempt.
    supervision = {"worker": RoleSupervision(awaited=True, on_failure="fatal", watched=True)}

    def roles(self, spec: "JobSpec") -> list[str]:
        return ["worker"] * spec.cluster.workers

    def bundles(self, spec: "JobSpec") -> list[dict[str, float]]:
        return [worker_bundle(spec.cluster) for _ in range(spec.cluster.workers)]

    def assign(self, locations: "list[ActorLocation]", spec: "JobSpec") -> "list[Task]":
        from raytf.rendezvous import assign_ranks

        return assign_ranks(locations)

    def role_name(self, task: "Task") -> str:
        return "chief" if task.rank == 0 else "worker"

    def rank_zero_tf_config(self, spec: "JobSpec") -> dict:
        return {"cluster": {"worker": ["localhost:1"] * spec.cluster.workers}, "task": {"type": "worker", "index": 0}}

    def check(self, spec: "JobSpec") -> None:
        from raytf.spec import ClusterSpec

        # compared with the defaults, not "was it given": a spec dumped and parsed again (a sweep's
        # trials) carries every key
        given = [k for k in PS_KEYS if getattr(spec.cluster, k) != ClusterSpec.model_fields[k].default]
        if given:
            raise ValueError(f"cluster.{given[0]} is for strategy: parameter_server; remove it, or set "
                             f"strategy: parameter_server")
        if spec.cluster.communication == "nccl" and spec.cluster.gpus_per_worker == 0:
            raise ValueError("cluster.communication: nccl needs a GPU on every worker, and cluster.gpus_per_worker "
                             "is 0 (CPU workers); use communication: ring (or auto), or give each worker a GPU")

    def check_batch(self, spec: "JobSpec") -> None:
        replicas, batch = spec.cluster.replicas, spec.train.global_batch_size
        if batch % replicas:
            raise ValueError(f"train.global_batch_size {batch} is not divisible by {replicas} replicas "
                             f"({spec.cluster.workers} workers x {spec.cluster.replicas_per_worker}); "
                             f"use {nearest_multiples(batch, replicas)}")


MIRRORED = Mirrored()
