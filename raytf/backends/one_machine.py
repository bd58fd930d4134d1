"""The one-machine strategies of the tf.distribute guide: OneDeviceStrategy (one task on one device, for
debugging a job on the cluster with everything else the same) and CentralStorageStrategy (one task with
several GPUs, its variables on the machine's CPU). One task, no collectives across machines, so no
elastic restarts; raytf's loop, train_fn, checkpoints, export and sweeps are those of mirrored."""
from __future__ import annotations

from typing import TYPE_CHECKING

from raytf.backends.base import RoleSupervision
from raytf.backends.mirrored import Mirrored

if TYPE_CHECKING:
    from raytf.spec import JobSpec


class OneMachine(Mirrored):
    actor_module = "raytf.actor.one_machine"
    supports_elastic = False
    rescues_peers = False  # one task: no survivor to keep the state
    default_workers = 1  # raytf.spec fills it in (ONE_TASK_STRATEGIES)
    supervision = {"worker": RoleSupervision(awaited=True, on_failure="fatal", watched=True)}
    own_step_call = "strategy.run"
    why_one_task = ""
    tf_strategy = ""  # the tf.distribute class the task builds (raytf.actor.one_machine)

    def check(self, spec: "JobSpec") -> None:
        cluster = spec.cluster
        refused = [
            (cluster.workers != 1, f"cluster.workers: {cluster.workers}",
             f"set cluster.workers: 1 ({self.why_one_task}), or use strategy: mirrored for several tasks"),
            (spec.failure.elastic is not None, "failure.elastic", "remove it: one task cannot go on with fewer"),
            (cluster.communication != "auto" or cluster.collective_timeout_s is not None,
             "cluster.communication" if cluster.communication != "auto" else "cluster.collective_timeout_s",
             "remove it: it sets MultiWorkerMirrored's collectives between tasks, and there is one task"),
            (cluster.gpu_placement is not None, f"cluster.gpu_placement: {cluster.gpu_placement}",
             "remove it: one task has one bundle (set cluster.gpus_per_worker)"),
        ]
        for bad, what, fix in refused:
            if bad:
                raise ValueError(f"{what} is not supported with strategy: {self.name}; {fix}")
        super().check(spec)  # no parameter-server keys


class OneDevice(OneMachine):
    name = "one_device"
    tf_strategy = "OneDeviceStrategy"
    keras3_fit_problem = ""  # Keras 3's model.fit works under OneDeviceStrategy
    why_one_task = "OneDeviceStrategy runs on one device of one machine"

    def check(self, spec: "JobSpec") -> None:
        super().check(spec)
        if spec.cluster.gpus_per_worker > 1:
            raise ValueError(f"cluster.gpus_per_worker: {spec.cluster.gpus_per_worker:g} is more than the one device "
                             f"strategy: one_device uses; set it to 1 (or 0: the CPU), or use strategy: "
                             f"central_storage or mirrored for several GPUs")


class CentralStorage(OneMachine):
    name = "central_storage"
    tf_strategy = "CentralStorageStrategy"
    replicated_variables = False  # one copy of each variable, on the CPU: nothing to keep in sync
    keras3_fit_problem = ""  # Keras 3's model.fit works under CentralStorageStrategy
    why_one_task = "CentralStorageStrategy is one machine's: its GPUs compute, its CPU holds the variables"


ONE_DEVICE = OneDevice()
CENTRAL_STORAGE = CentralStorage()
