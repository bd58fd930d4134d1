"""Preemption on the local multi-node cluster: a node of the job drained (as a spot reclaim or `ray drain-node`
does) mid-epoch ends in a job that trained every optimizer step exactly once: every worker stops at one
common step, the job checkpoints there, and restarts without the node, free of failure.max_restarts."""
import shutil

import pytest
import ray

from raytf.driver.controller import run
from raytf.job import load
from tests.conftest import REPO, assert_nothing_left, base_spec, write_job
from tests.faults import AtSteps, DiesWhenAskedToStop, drain
from tests.test_parameter_server import CHIEF_CRASHED, criteo_data, ps_dir, ps_spec  # noqa: F401 (fixtures)
from tests.test_parameter_server import STEPS_PER_EPOCH as PS_STEPS_PER_EPOCH

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), pytest.mark.flaky(reruns=1, only_rerun=[CHIEF_CRASHED])]

STEPS_PER_EPOCH = 1437 // 16  # global batch 16 over 2 workers: 89 steps per epoch
EPOCHS = 5


@pytest.fixture(scope="module")
def spot_nodes(cluster):
    """Six 1-CPU nodes with the custom resource `spot` (what cluster.yaml's spot node type declares) and a
    plain one; the jobs here ask for `spot`, one worker per node. The first test drains two, the others one each;
    drained nodes exit by themselves once idle, so the last test has two left, then one."""
    c, _ = cluster
    spot = [c.add_node(num_cpus=1, resources={"spot": 1}) for _ in range(6)]
    plain = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield spot, plain
    for node in spot + [plain]:
        if node in c.worker_nodes:
            c.remove_node(node, allow_graceful=False)


def spot_spec(job_dir, **changes):
    spec = base_spec(train={"epochs": EPOCHS, "global_batch_size": 16, "seed": 3},
                     cluster={"workers": 2, "cpus_per_worker": 1, "resources_per_worker": {"spot": 1},
                              "reserve_timeout_s": 30},
                     checkpoint={"dir": str(job_dir / "ckpt"), "every_steps": 40, "keep": 2},
                     failure={"max_restarts": 0, "hang_timeout_s": 60}, output={"tensorboard": False},
                     optimizer={"name": "adam", "learning_rate": 0.003})
    for key, value in changes.items():
        spec[key] = {**spec[key], **value}
    return spec


def alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def node_of(rank: int, drained: list):
    def action(group):
        drained.append(group.tasks[rank].node_id)
        drain(group.tasks[rank].node_id, deadline_s=30)
    return action


def test_a_drained_node_costs_no_step_and_no_restart_budget_even_when_it_goes_before_its_checkpoint(
        cluster, spot_nodes, job_dir):
    """Deadline 30 s, rank 1's node, mid-epoch 2; before that, a node the job does not use is drained too. In the
    next attempt rank 1's node is drained again (step 212), and its actor dies as soon as the ranks were asked to stop (before
    the stop step and its checkpoint): the survivor's state is the restart's, and no step is lost either."""
    _, plain = spot_nodes
    drained = []
    trigger = AtSteps([(30, lambda group: drain(plain.node_id, deadline_s=30)), (120, node_of(1, drained))])
    # in epoch 3, some steps after the resume, with no periodic checkpoint in the way (every_steps past the run's
    # 712): the second attempt starts at the first drain's checkpoint-now (step ~130-230, by the load) and its
    # drain comes as soon as it trains. With checkpoints every 40 steps, a drain seen within 0.25 s at step 200 had
    # rank 1 die right after the checkpoint at 200, and a loaded clean-clone run (2026-12-08) saw it at step 239,
    # the death just after the one at 240: the restart resumed from that checkpoint (no survivor held a later
    # step), not from the survivor's state this test is about
    again = AtSteps([(212, node_of(1, drained))], attempts={2})
    dier = DiesWhenAskedToStop(rank=1, attempt=2)
    # 8 epochs: with 5, only ~3.5 s of training followed the drain at step 120, and under load the job once ended
    # before the notice became a stop step (no restart)
    epochs = 8
    group_cls = type("DrainTwice", (trigger.group_cls, again.group_cls, dier.group_cls), {})
    spec = spot_spec(job_dir, train={"epochs": epochs}, checkpoint={"every_steps": 1000})
    result = run(load(write_job(job_dir, spec)), group_cls=group_cls)

    assert [at for at, _, _ in trigger.done] == [30, 120], "the drains did not happen while training"
    assert dier.killed_after, "the second drained node's actor was never killed"
    assert result.status == "succeeded"  # max_restarts 0: the preemptions were not charged
    restart, vanished = result.restarts  # the unused node's drain changed nothing
    assert restart["kind"] == "preempted" and restart["node_id"] == drained[0] and restart["ranks"] == [1]
    assert 25 <= restart["deadline_s_after_notice"] <= 30
    # every worker stopped at one step, the checkpoint was written there, the restart began there
    assert restart["step_saved"] == restart["resumed_from_step"] == restart["last_step"] > 120
    assert restart["steps_lost"] == 0 and restart["notice_to_checkpoint_s"] < 30
    # the node went first: rank 0 kept the state at the last step both finished, short of the stop step
    assert vanished["kind"] == "preempted" and vanished["node_id"] == drained[1] and \
        vanished.get("state_from") == "rank 0", {k: vanished.get(k) for k in ("reason", "cause", "last_step", "stop_step")}
    assert vanished["resumed_from_step"] == vanished["last_step"] < dier.killed_after[0], vanished
    assert vanished["steps_lost"] == 0 and "resumes from rank 0's state" in vanished["reason"], vanished
    planned = epochs * STEPS_PER_EPOCH
    assert [t["optimizer_steps"] for t in result.tasks] == [planned, planned]  # each step trained once
    assert len({t["weights_digest"] for t in result.tasks}) == 1
    assert not set(drained) & {t["node_id"] for t in result.tasks}
    assert [h["epoch"] for h in result.history] == list(range(1, epochs + 1))
    assert [h["examples"] for h in result.history] == [STEPS_PER_EPOCH * 16] * epochs
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert not alive(drained[0]) and not alive(plain.node_id)  # idle drained raylets exit
    assert_nothing_left()


def test_under_parameter_servers_a_drained_worker_node_is_let_go_and_training_goes_on(cluster, spot_nodes, ps_dir,
                                                                                       criteo_data):
    """A node holding only a parameter-server worker: the job survives that worker's loss (it is replaced), so
    no checkpoint-now and no restart; the chief's steps go on. (A drained chief or ps node takes the
    checkpoint-now path: tests/test_controller.py.)"""
    drained = []
    trigger = AtSteps([(20, node_of(3, drained))])  # worker 1 (rank 3), as the chief passes step 20
    spec = ps_spec(criteo_data, train={"epochs": 4},
                   cluster={"resources_per_worker": {"spot": 1}, "cpus_per_worker": 0.5},
                   checkpoint={"dir": str(ps_dir / "ckpt"), "every_steps": 50, "keep": 2})
    result = run(load(write_job(ps_dir, spec)), group_cls=trigger.group_cls)

    assert [at for at, _, _ in trigger.done] == [20], "the drain did not happen while training"
    assert result.status == "succeeded" and result.restarts == []
    assert result.tasks[0]["steps"] == 4 * PS_STEPS_PER_EPOCH  # the chief's count: every step once, one attempt
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert_nothing_left()


def test_a_train_fn_stops_in_ctx_step_and_saves_its_own_checkpoint(cluster, spot_nodes, job_dir):
    """The tutorial-style custom loop (jobs/digits_custom.py): ctx.step stops it at the common step, after
    saving the ctx.checkpoint it made; the restart restores it there."""
    shutil.copy(REPO / "jobs" / "digits_custom.py", job_dir)
    drained = []
    trigger = AtSteps([(30, node_of(1, drained))])
    spec = spot_spec(job_dir, train={"epochs": 2})
    spec.update(model="digits_custom:build_model", train_fn="digits_custom:train")
    for key in ("optimizer", "loss", "metrics"):
        del spec[key]
    result = run(load(write_job(job_dir, spec)), group_cls=trigger.group_cls)

    restart, = result.restarts
    assert restart["kind"] == "preempted" and restart["node_id"] == drained[0]
    assert restart["step_saved"] == restart["resumed_from_step"] == restart["last_step"] > 30
    assert restart["steps_lost"] == 0
    assert [t["steps"] for t in result.tasks] == [2 * STEPS_PER_EPOCH] * 2
    assert len({t["weights_digest"] for t in result.tasks}) == 1 and [h["epoch"] for h in result.history] == [1, 2]
    assert_nothing_left()

