"""The controller stepped without Ray or TensorFlow: an in-memory worker group on a fake clock
(tests/fakes.py). Each test drives a whole job through its states in well under a second."""
import json
import subprocess
import sys
import textwrap
import time

import pytest

from raytf.checkpoint import Storage
from raytf.driver.callbacks import Callback, TrialStopped
from raytf.driver.controller import DONE, FAILED, RUNNING, STARTING, Controller
from raytf.driver.group import TaskError
from raytf.driver.policy import Limits
from raytf.errors import PlacementTimeout, TrainingFailed
from raytf.job import Job, parse
from tests.conftest import REPO, base_spec
from tests.fakes import (
    FakeClock,
    FakeResources,
    Script,
    actor_died,
    checkpoint_corrupt,
    collective_error,
    user_error,
)

pytestmark = pytest.mark.timeout(20)


def make_job(tmp_path, **sections) -> Job:
    spec = parse(base_spec(output={"dir": str(tmp_path / "out"), "tensorboard": False}, **sections))
    return Job(spec=spec, job_dir=tmp_path)


def make(tmp_path, script, job, resume=False, **world):
    clock = FakeClock()
    resources = FakeResources(clock, script, **world)
    return Controller(job, resources, code=None, clock=clock, resume=resume), resources, clock


def run_fast(c: Controller):
    started = time.perf_counter()
    try:
        return c.run()
    finally:
        assert time.perf_counter() - started < 1.0, "a stepped job should take well under a second"


def test_a_clean_job_steps_through_its_states_to_done(tmp_path):
    c, world, clock = make(tmp_path, lambda attempt, task: Script(finish_after=12.0), make_job(tmp_path))
    states = [c.state]
    while c.state not in (DONE, FAILED):
        states.append(c.step())
    assert states[:3] == ["placing", STARTING, RUNNING] and states[-1] == DONE
    assert c.result.status == "succeeded" and [t["rank"] for t in c.result.tasks] == [0, 1]
    assert c.result.restarts == [] and world.groups[0].stopped
    assert (tmp_path / "out" / "result.json").is_file()
    # actors are named at creation, from the placement alone; the names are the ranks they then got
    group = world.groups[0]
    assert [group.names[t.bundle_index] for t in group.tasks] == ["raytf:t:worker-0", "raytf:t:worker-1"]
    c.run()  # nothing left to do; the placement group is let go
    assert world.released == ["pg-1"]


def test_a_hang_is_caught_at_hang_timeout_s(tmp_path):
    job = make_job(tmp_path, failure={"hang_timeout_s": 30, "max_restarts": 1})
    script = lambda attempt, task: Script(finish_after=200.0, hang_after=5.0 if attempt == 1 and task.rank == 1 else None)  # noqa: E731
    c, world, clock = make(tmp_path, script, job)
    result = run_fast(c)
    assert result.status == "succeeded" and len(result.restarts) == 1
    restart = result.restarts[0]
    assert restart["kind"] == "hang" and restart["ranks"] == [1]
    assert "no progress from rank(s) [1] for 30s" in restart["reason"]
    hung_at = clock.t  # the restart's time is the fake clock's when the hang was declared
    started = world.groups[0].handles[1].started
    detected_after = restart["time"] - (started + 5.0)
    assert 30 <= detected_after <= 30 + 2 * Limits().poll_interval_s, detected_after
    assert hung_at > restart["time"]
    # every rank's stacks were asked for and written before the teardown, a line per rank
    [named] = result.hangs
    assert named["attempt"] == 1 and named["ranks"] == [1] and named["torn_down"]
    rank_0, rank_1 = named["lines"]  # with each rank's last step: rank 1's is the one it stopped at, 5 s in
    assert rank_0.startswith("rank 0 (chief, step ") and rank_0.endswith(
        " train): a TensorFlow step or collective at steps.py:1 in step"), rank_0
    assert rank_1 == (f"rank 1 (worker, step {int(5 * Script().steps_per_s)} train, no progress): "
                      f"user code at tmodel.py:7 in stall")
    report = tmp_path / "out" / named["folder"] / "rank-1.txt"
    assert report.read_text().startswith(named["lines"][1]) and "Thread MainThread (training)" in report.read_text()


def test_with_hang_mode_observe_a_hang_is_named_once_and_the_job_goes_on(tmp_path):
    job = make_job(tmp_path, failure={"hang_timeout_s": 30, "max_restarts": 0, "hang_mode": "observe"})
    script = lambda attempt, task: Script(finish_after=200.0, hang_after=5.0 if task.rank == 1 else None)  # noqa: E731
    c, world, clock = make(tmp_path, script, job)
    result = run_fast(c)
    assert result.status == "succeeded" and result.restarts == []  # it ended as it would have
    [named] = result.hangs  # once, though rank 1 stayed silent for the rest of the run
    assert named["ranks"] == [1] and not named["torn_down"]
    assert (tmp_path / "out" / "hangs" / "attempt-1" / "rank-0.txt").is_file()


def test_a_rank_that_says_no_steps_is_alive_while_it_computes_and_hung_once_it_stops(tmp_path):
    # A train_fn's tf.keras fit reports nothing until its epoch ends: an epoch of 3x hang_timeout_s succeeds.
    job = make_job(tmp_path, train_fn="own:train", failure={"hang_timeout_s": 8, "max_restarts": 1})
    fit = lambda attempt, task: Script(finish_after=24.0, says_steps=False, cpu_share=0.7)  # noqa: E731
    result = run_fast(make(tmp_path, fit, job)[0])
    assert result.status == "succeeded" and result.restarts == []
    # A rank idle while its peer computes alone (its longer first trace, the chief's own export: CI under load
    # saw a 4-s hang_timeout_s fire so) is waiting for it in the next collective, not hung.
    one_computes = lambda attempt, task: Script(finish_after=24.0, says_steps=False,  # noqa: E731
                                                cpu_share=0.7 if task.rank == 0 else 0.005)
    result = run_fast(make(tmp_path, one_computes, make_job(tmp_path, train_fn="own:train",
                                                            failure={"hang_timeout_s": 8, "max_restarts": 1}))[0])
    assert result.status == "succeeded" and result.restarts == []
    # ... but not forever: a peer spinning in its own code for good is no step either (Limits.first_step_s)
    spins = lambda attempt, task: Script(finish_after=200.0 if attempt == 1 else 5.0, says_steps=False,  # noqa: E731
                                         cpu_share=0.7 if task.rank == 0 else 0.005)
    c, world, clock = make(tmp_path, spins, make_job(tmp_path, train_fn="own:train",
                                                     failure={"hang_timeout_s": 8, "max_restarts": 1}))
    result = run_fast(c)
    [restart] = result.restarts
    assert restart["kind"] == "hang" and restart["ranks"] == [1], restart
    assert "while rank(s) [0] computed alone" in restart["reason"], restart["reason"]
    detected_after = restart["time"] - world.groups[0].handles[1].started
    assert Limits().first_step_s <= detected_after <= Limits().first_step_s + 2 * Limits().poll_interval_s
    # A rank asleep, and its peer blocked on it in a collective: both use next to no CPU, caught as a rank that
    # stops stepping is.
    asleep = lambda attempt, task: Script(finish_after=24.0, says_steps=False,  # noqa: E731
                                          cpu_share=0.7 if attempt > 1 else 0.005)
    c, world, clock = make(tmp_path, asleep, make_job(tmp_path, train_fn="own:train",
                                                      failure={"hang_timeout_s": 8, "max_restarts": 1}))
    result = run_fast(c)
    assert result.status == "succeeded" and [r["kind"] for r in result.restarts] == ["hang"]
    assert result.restarts[0]["ranks"] == [0, 1]
    detected_after = result.restarts[0]["time"] - world.groups[0].handles[1].started
    assert 8 <= detected_after <= 8 + 2 * Limits().poll_interval_s, detected_after
    # Stuck after computing for a while (its peer then blocked on it): caught within hang_timeout_s of the last
    # busy window.
    stuck = lambda attempt, task: Script(finish_after=60.0, says_steps=False,  # noqa: E731
                                         hang_after=10.0 if attempt == 1 else None)
    c, world, clock = make(tmp_path, stuck, make_job(tmp_path, train_fn="own:train",
                                                     failure={"hang_timeout_s": 8, "max_restarts": 1}))
    result = run_fast(c)
    detected_after = result.restarts[0]["time"] - (world.groups[0].handles[1].started + 10.0)
    assert [r["kind"] for r in result.restarts] == ["hang"] and 8 <= detected_after <= 8 + 4 + 2, detected_after
    # A parameter-server chief waiting in coordinator.join(): idle, but its workers finish what it scheduled.
    joins = lambda attempt, task: Script(finish_after=24.0, says_steps=False, cpu_share=0.005,  # noqa: E731
                                         work_per_s=2.0)
    result = run_fast(make(tmp_path, joins, make_job(tmp_path, train_fn="own:train",
                                                     failure={"hang_timeout_s": 8}))[0])
    assert result.status == "succeeded" and result.restarts == []


def test_raytfs_loop_busy_before_its_first_step_is_declared_hung(tmp_path):
    # A data.preprocess that never returns (a FeatureSpace adapted on its first call) computes and says no step.
    # raytf's loop says every step, so CPU use before the first one is no sign of life; the first step may take
    # Limits.first_step_s (its trace), or hang_timeout_s where that is longer. A train_fn's CPU counts (above).
    busy = lambda attempt, task: Script(finish_after=200.0 if attempt == 1 else 5.0,  # noqa: E731
                                        says_steps=attempt > 1, cpu_share=0.9)
    for hang_timeout_s, caught_after in ((8, Limits().first_step_s), (90, 90)):
        c, world, clock = make(tmp_path, busy, make_job(tmp_path, failure={"hang_timeout_s": hang_timeout_s,
                                                                           "max_restarts": 1}))
        result = run_fast(c)
        assert result.status == "succeeded" and [r["kind"] for r in result.restarts] == ["hang"]
        assert "no first step from rank(s) [0, 1]" in result.restarts[0]["reason"], result.restarts[0]["reason"]
        detected_after = result.restarts[0]["time"] - world.groups[0].handles[0].started
        assert caught_after <= detected_after <= caught_after + 2 * Limits().poll_interval_s, detected_after


def test_a_failed_job_keeps_its_epochs_tasks_restarts_and_the_traceback(tmp_path):
    job = make_job(tmp_path, failure={"hang_timeout_s": 30, "max_restarts": 1})
    crash = user_error("'Mean' object has no attribute 'reset_states'", where="train.py:57")
    script = lambda attempt, task: (Script(finish_after=None, fail_after=3.0, error=actor_died())  # noqa: E731
                                    if attempt == 1 and task.rank == 1 else
                                    Script(finish_after=None, fail_after=25.0, error=crash, epoch_s=10.0)
                                    if attempt == 2 else Script(finish_after=None, epoch_s=10.0))
    c, world, clock = make(tmp_path, script, job)
    with pytest.raises(TrainingFailed) as raised:
        run_fast(c)
    assert "train.py:57: ValueError: 'Mean' object" in str(raised.value)
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["status"] == "failed" and "train.py:57" in saved["error"]
    assert [e["epoch"] for e in saved["history"]] == [1, 2], "the epochs trained before the failure"
    assert [t["rank"] for t in saved["tasks"]] == [0, 1] and all(t["node_ip"] for t in saved["tasks"])
    assert [r["kind"] for r in saved["restarts"]] == ["actor_died"]
    assert 'File "train.py:57"' in saved["traceback"]


def test_peer_errors_within_the_grace_are_collected_root_cause_first(tmp_path):
    def script(attempt, task):
        if task.rank == 1:
            return Script(fail_after=3.0, error=user_error("bad batch"))
        return Script(fail_after=4.0, error=collective_error())  # the peer's broken collective, 1 s later

    c, world, clock = make(tmp_path, script, make_job(tmp_path, failure={"max_restarts": 3}))
    with pytest.raises(TrainingFailed) as info:
        run_fast(c)
    message = str(info.value)
    assert message.startswith("training failed: rank(s) 1: ValueError: bad batch; then rank(s) 0: UnavailableError")
    assert info.value.causes == {"ValueError: bad batch": [1],
                                 "UnavailableError: Collective ops is aborted by: peer down": [0]}
    assert len(world.groups) == 1  # the job's own error: no restart


def test_two_ranks_failing_differently_both_keep_their_tracebacks(tmp_path):
    def script(attempt, task):
        return Script(fail_after=3.0 + task.rank, error=user_error(f"bad shard {task.rank}", where=f"prep.py:{10 + task.rank}"))

    c, world, clock = make(tmp_path, script, make_job(tmp_path))
    with pytest.raises(TrainingFailed) as info:
        run_fast(c)
    assert 'File "prep.py:10"' in info.value.traceback and 'File "prep.py:11"' in info.value.traceback  # -v shows both
    saved = json.loads((tmp_path / "out" / "result.json").read_text())
    assert saved["traceback"].startswith("--- rank 0 ---") and "--- rank 1 ---" in saved["traceback"]
    by_rank = {t["rank"]: t for t in saved["tasks"]}
    assert by_rank[0]["error"] == "prep.py:10: ValueError: bad shard 0" and 'File "prep.py:10"' in by_rank[0]["traceback"]
    assert by_rank[1]["error"] == "prep.py:11: ValueError: bad shard 1" and 'File "prep.py:11"' in by_rank[1]["traceback"]


def test_a_dead_actor_does_not_wait_for_its_peers(tmp_path):
    def script(attempt, task):
        if attempt == 1 and task.rank == 1:
            return Script(fail_after=3.0, error=actor_died())
        if attempt == 1:
            return Script(fail_after=4.0, error=collective_error())
        return Script(finish_after=5.0)

    c, world, clock = make(tmp_path, script, make_job(tmp_path, failure={"max_restarts": 1}))
    result = run_fast(c)
    restart = result.restarts[0]
    assert restart["kind"] == "actor_died" and "then" not in restart["reason"]  # the peer was not waited for
    assert restart["time"] == world.groups[0].handles[1].started + 3.0


def test_a_dead_actor_is_answered_from_the_survivor_that_got_furthest_and_loses_no_step(tmp_path):
    """Rank 2 dies at step 30: the survivors' collectives are failed at once, each keeps its state on the way out
    (rank 0 at step 29, rank 1 at 30: it finished the step the other did not), and rank 1's is uploaded as the
    newest checkpoint; the restart resumes there, its record says so, and no step is lost. Without a
    checkpoint.dir there is nowhere to put it: nobody is asked."""
    def script(attempt, task):
        if attempt == 1 and task.rank == 2:
            return Script(fail_after=3.0, error=actor_died())
        if attempt == 1:
            return Script(fail_after=3.2, error=collective_error(), rescue_step=29 + task.rank)
        return Script(finish_after=5.0)

    sections = dict(cluster={"workers": 3, "cpus_per_worker": 0.5}, train={"global_batch_size": 63},
                    failure={"max_restarts": 1})
    c, world, clock = make(tmp_path, script, make_job(tmp_path, **sections,
                                                      checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50}))
    _checkpoints(tmp_path, [10])
    world.on_checkpoint = lambda step: _checkpoints(tmp_path, [step]) and None
    result = run_fast(c)
    assert result.status == "succeeded" and world.aborted == [[0, 1]] and world.rescue_uploads == [(1, 30)]
    restart = result.restarts[0]
    assert restart["kind"] == "actor_died" and restart["ranks"] == [2] and restart["state_from"] == "rank 1"
    assert restart["resumed_from_step"] == 30 and restart["last_step"] == 30 and restart["steps_lost"] == 0
    assert world.payloads[1].resume_from.step == 30

    c, world, clock = make(tmp_path / "x", script, make_job(tmp_path / "x", **sections))
    result = run_fast(c)
    assert world.aborted == [] and world.rescue_uploads == [] and "state_from" not in result.restarts[0]


def test_a_peer_cut_off_is_answered_from_the_survivors_state_too(tmp_path):
    """Rank 1's host drops off the network: nobody sees it die; rank 0's collective times out (kind collective),
    and the state it kept is the restart's. The silent rank holds none."""
    def script(attempt, task):
        if attempt == 1 and task.rank == 0:
            return Script(fail_after=3.0, error=collective_error(), rescue_step=25)
        if attempt == 1:
            return Script(finish_after=None, hang_after=2.5)
        return Script(finish_after=5.0)

    job = make_job(tmp_path, failure={"max_restarts": 1}, checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50})
    c, world, clock = make(tmp_path, script, job)
    world.on_checkpoint = lambda step: _checkpoints(tmp_path, [step]) and None
    result = run_fast(c)
    restart = result.restarts[0]
    assert restart["kind"] == "collective" and restart["state_from"] == "rank 0" and world.rescue_uploads == [(0, 25)]
    assert restart["resumed_from_step"] == 25 and restart["steps_lost"] == 0 and world.aborted == []


def test_a_hang_is_answered_from_the_state_of_the_rank_that_waited_for_the_stalled_one(tmp_path):
    """Rank 1's input stalls; rank 0 waits for it in the step's all-reduce. At hang_timeout_s every rank's
    collectives are failed: rank 0 keeps the state of the last step both finished, which the restart resumes
    from. Rank 1, stuck outside any collective, holds none."""
    def script(attempt, task):
        if attempt == 1:
            return Script(finish_after=None, hang_after=2.5, rescue_step=25 if task.rank == 0 else None)
        return Script(finish_after=5.0)

    job = make_job(tmp_path, failure={"max_restarts": 1, "hang_timeout_s": 10},
                   checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50})
    c, world, clock = make(tmp_path, script, job)
    world.on_checkpoint = lambda step: _checkpoints(tmp_path, [step]) and None
    result = run_fast(c)
    restart = result.restarts[0]
    assert restart["kind"] == "hang" and world.aborted == [[0, 1]] and world.rescue_uploads == [(0, 25)]
    assert restart["state_from"] == "rank 0" and restart["resumed_from_step"] == 25 and restart["steps_lost"] == 0
    assert result.status == "succeeded"


def test_ranks_that_die_together_are_all_named(tmp_path):
    """A node with two ranks goes away: both deaths arrive in one poll, and both ranks are named."""
    def script(attempt, task):
        return Script(fail_after=3.0, error=actor_died()) if attempt == 1 else Script()

    job = make_job(tmp_path, cluster={"workers": 3, "cpus_per_worker": 0.5}, train={"global_batch_size": 63},
                   failure={"max_restarts": 1})
    c, world, clock = make(tmp_path, script, job)
    result = run_fast(c)
    assert result.restarts[0]["ranks"] == [0, 1, 2] and result.restarts[0]["kind"] == "actor_died"


def test_a_parameter_server_failure_is_not_blamed_on_a_worker_lost_meanwhile(tmp_path):
    """A ps task fails; a worker dies within the grace: the worker is a loss to replace, not the cause."""
    job = make_job(tmp_path, strategy="parameter_server", cluster={"workers": 1, "ps": 1, "cpus_per_worker": 0.5})

    def script(attempt, task):
        if task.role == "ps":
            return Script(finish_after=None, fail_after=1.0, error=collective_error())
        if task.role == "worker":
            return Script(finish_after=None, fail_after=1.5, error=actor_died())
        return Script(finish_after=10.0)

    c, world, _ = make(tmp_path, script, job)
    with pytest.raises(TrainingFailed) as info:
        run_fast(c)
    assert str(info.value).startswith("training failed: ps 0 (rank 1, 10.0.0.2): rank(s) 1: UnavailableError")
    assert "actor died" not in str(info.value)


def test_a_taken_port_reruns_the_rendezvous(tmp_path):
    c, world, _ = make(tmp_path, lambda a, t: Script(), make_job(tmp_path), port_taken_times=1)
    result = run_fast(c)
    assert result.status == "succeeded" and result.rendezvous_attempts == 2 and len(world.groups) == 2
    assert world.groups[0].stopped


def test_a_port_taken_every_time_fails_the_attempt_after_the_rendezvous_limit(tmp_path):
    c, world, _ = make(tmp_path, lambda a, t: Script(), make_job(tmp_path), port_taken_times=99)
    with pytest.raises(TrainingFailed, match="was taken"):
        run_fast(c)
    assert len(world.groups) == Limits().rendezvous_attempts


def _checkpoints(tmp_path, steps):
    storage = Storage(str(tmp_path / "ckpt"))
    for step in steps:
        local = tmp_path / f"local-{step}"
        local.mkdir()
        (local / "state").write_text("x")
        storage.upload(str(local), {"step": step, "epoch": 1, "step_in_epoch": step, "history": [], "world_size": 2})
    return storage


def test_a_corrupt_checkpoint_falls_back_to_the_one_before_free_of_charge(tmp_path):
    storage = _checkpoints(tmp_path, [10, 20])
    latest = storage.latest()

    def script(attempt, task):
        if attempt == 1 and task.rank == 0:
            return Script(fail_after=0.5, error=checkpoint_corrupt(latest.path))
        return Script(finish_after=5.0)

    job = make_job(tmp_path, checkpoint={"dir": str(tmp_path / "ckpt")}, failure={"max_restarts": 0})
    c, world, _ = make(tmp_path, script, job, resume=True)
    result = run_fast(c)
    assert [p.resume_from.step for p in world.payloads] == [20, 10]
    assert result.restarts[0]["kind"] == "checkpoint" and result.restarts[0]["resumed_from_step"] == 10
    assert result.status == "succeeded"  # max_restarts 0: the fallback was not charged


def test_a_checkpoint_of_another_model_ends_the_job_and_is_never_trained_over(tmp_path):
    storage = _checkpoints(tmp_path, [8])
    latest = storage.latest()
    before = sorted(p.name for p in (tmp_path / "ckpt").rglob("*"))
    said = f"checkpoint {latest.path} does not fit this job's model (ValueError: Received incompatible tensor)"
    mismatch = TaskError("CheckpointMismatch", said, False, f"CheckpointMismatch: {said}")
    script = lambda attempt, task: Script(fail_after=0.5, error=mismatch) if attempt == 1 else Script()  # noqa: E731
    job = make_job(tmp_path, checkpoint={"dir": str(tmp_path / "ckpt")}, failure={"max_restarts": 2})
    c, world, _ = make(tmp_path, script, job, resume=True)
    with pytest.raises(TrainingFailed, match="does not fit this job's model"):
        run_fast(c)
    assert len(world.groups) == 1, "no restart, no fresh start"
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*")) == before


def test_an_elastic_restart_shrinks_to_what_the_cluster_holds(tmp_path):
    job = make_job(tmp_path, train={"global_batch_size": 24},
                   cluster={"workers": 4, "cpus_per_worker": 0.5, "reserve_timeout_s": 30},
                   failure={"max_restarts": 1, "elastic": {"min_workers": 2}})

    def script(attempt, task):
        return Script(fail_after=2.0, error=actor_died()) if attempt == 1 and task.rank == 3 else Script()

    world_capacity = lambda reservation: 4 if reservation == 1 else 3  # noqa: E731  (a node went away)
    c, world, _ = make(tmp_path, script, job, capacity=world_capacity)
    world.pg_alive = False  # the held group cannot come back whole
    result = run_fast(c)
    assert world.reservations == [4, 4, 3]  # full size first, then 3 (3 divides 24)
    assert result.workers == 3 and result.restarts[0]["workers"] == 3
    assert world.payloads[-1].spec.cluster.workers == 3 and len(result.tasks) == 3


def test_an_elastic_job_grows_back_to_full_size_once_the_missing_workers_fit_again(tmp_path):
    """4 -> 2 after a node is lost; every grow_check_s the driver asks whether the 2 missing bundles fit; once
    they do, every worker stops at one step with a checkpoint and the job restarts on 4 from it: 0 steps lost,
    not charged to max_restarts (1, used by the loss)."""
    storage = Storage(str(tmp_path / "ckpt"))
    job = make_job(tmp_path, train={"global_batch_size": 24},
                   cluster={"workers": 4, "cpus_per_worker": 0.5, "reserve_timeout_s": 30},
                   checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50},
                   failure={"max_restarts": 1, "elastic": {"min_workers": 2, "grow_check_s": 5}})

    def script(attempt, task):
        if attempt == 1 and task.rank == 3:
            return Script(fail_after=2.0, error=actor_died())
        # the 2-worker attempt has saved a checkpoint (a train_fn that never does is never stopped to grow)
        return Script(finish_after=40.0, checkpoint_s=0.1 if attempt == 2 else None)

    capacity = lambda reservation: 2 if reservation in (2, 3, 4) else 4  # noqa: E731  (4, then 3 and 2, then 4)
    c, world, clock = make(tmp_path, script, job, capacity=capacity, nodes=3)
    world.pg_alive = False
    world.room_from = clock.now() + 20.0
    world.on_checkpoint = lambda step: _checkpoints(tmp_path, [step]) and None
    result = run_fast(c)
    assert result.status == "succeeded" and world.reservations == [4, 4, 3, 2, 4]
    assert world.probes and set(world.probes) == {2}  # the 2 missing workers' bundles, every interval until they fit
    lost, grown = result.restarts
    assert (lost["kind"], lost["workers"]) == ("actor_died", 2)
    (ranks, step), = world.stop_requests
    assert ranks == [0, 1]  # the attempt on 2 workers stopped at one step
    assert grown["kind"] == "resized" and grown["workers"] == 4 and grown["from_workers"] == 2
    assert grown["step_saved"] == step == grown["resumed_from_step"] and grown["steps_lost"] == 0
    assert grown["batch"]["global_batch_size"] == 24 and grown["batch"]["accumulation_steps"] == 1
    assert lost["batch"]["accumulation_steps"] == 2  # the effective batch 24 throughout
    assert result.workers == 4 and len(result.tasks) == 4 and storage.latest().step == step
    assert "growing back from 2 to 4 workers" in grown["reason"] and "pg-4" in world.released


@pytest.mark.parametrize("placement, saved", [("strict_spread", 0.1), ("pack", None)])
def test_no_probe_to_grow_under_a_strict_placement_or_before_the_attempt_saved_a_checkpoint(tmp_path, placement, saved):
    """A strict placement's full group is not the missing bundles placed apart; and an attempt that has saved
    nothing (a train_fn that never checkpoints) would lose all it trained to grow: it stays small."""
    job = make_job(tmp_path, train={"global_batch_size": 24},
                   cluster={"workers": 4, "cpus_per_worker": 0.5, "reserve_timeout_s": 30, "placement": placement},
                   checkpoint={"dir": str(tmp_path / "ckpt")},
                   failure={"max_restarts": 1, "elastic": {"min_workers": 2, "grow_check_s": 5}})

    def script(attempt, task):
        if attempt == 1 and task.rank == 3:
            return Script(fail_after=2.0, error=actor_died())
        return Script(finish_after=40.0, checkpoint_s=saved if attempt == 2 else None)

    c, world, clock = make(tmp_path, script, job, capacity=lambda r: 2 if r in (2, 3, 4) else 4, nodes=3)
    world.pg_alive = False
    world.room_from = clock.now()
    result = run_fast(c)
    assert world.probes == [] and result.workers == 2 and [r["kind"] for r in result.restarts] == ["actor_died"]


def test_without_elastic_a_cluster_too_small_is_exit_3(tmp_path):
    c, world, _ = make(tmp_path, lambda a, t: Script(), make_job(tmp_path), capacity=1)
    with pytest.raises(PlacementTimeout):
        run_fast(c)


def test_a_parameter_server_worker_is_replaced_and_taken_back(tmp_path):
    job = make_job(tmp_path, strategy="parameter_server", cluster={"workers": 2, "ps": 1, "cpus_per_worker": 0.5})

    def script(attempt, task):
        if task.role == "chief":
            return Script(finish_after=10.0, outcome={"recovered_workers": ["/job:worker/replica:0/task:1"]})
        if task.role == "worker" and task.index == 1:
            return Script(finish_after=None, fail_after=2.0, error=actor_died())
        return Script(finish_after=None)  # ps and workers serve until stopped

    c, world, _ = make(tmp_path, script, job)
    result = run_fast(c)
    assert result.status == "succeeded" and result.restarts == []
    assert world.replaced == [3]  # rank 3 = worker 1 (chief, ps, worker 0, worker 1)
    group = world.groups[0]
    assert [group.names[t.bundle_index] for t in group.tasks] == [
        "raytf:t:chief-0", "raytf:t:ps-0", "raytf:t:worker-0", "raytf:t:worker-1"]
    assert len(result.worker_losses) == 1
    loss = result.worker_losses[0]
    assert loss["worker"] == 1 and loss["replaced"] is True and loss["rejoined"] is True


def test_a_dead_ps_task_fails_the_attempt_naming_it(tmp_path):
    job = make_job(tmp_path, strategy="parameter_server", cluster={"workers": 1, "ps": 1, "cpus_per_worker": 0.5})

    def script(attempt, task):
        if task.role == "ps":
            return Script(finish_after=None, fail_after=1.0, error=actor_died())
        return Script(finish_after=None if task.role != "chief" else 10.0)

    c, world, _ = make(tmp_path, script, job)
    with pytest.raises(TrainingFailed, match=r"ps 0 \(rank 1, 10.0.0.2\): rank\(s\) 1: actor died"):
        run_fast(c)


def test_the_restart_budget_runs_out(tmp_path):
    script = lambda attempt, task: Script(fail_after=1.0, error=actor_died()) if task.rank == 1 else Script(finish_after=60)  # noqa: E731
    c, world, _ = make(tmp_path, script, make_job(tmp_path, failure={"max_restarts": 2}))
    with pytest.raises(TrainingFailed, match=r"failure.max_restarts \(2\) used up"):
        run_fast(c)
    assert len(world.groups) == 3 and all(g.stopped for g in world.groups)
    saved = (tmp_path / "out" / "result.json").read_text()
    assert saved.count('"kind": "actor_died"') == 2  # the decision log: two restarts, then the end


def test_warm_standbys_are_kept_only_while_a_charged_restart_is_left(tmp_path):
    """Warm processes serve the next restart; once failure.max_restarts is used up, a failure ends the job."""
    script = lambda attempt, task: (Script(fail_after=5.0, error=actor_died()) if attempt == 1 and task.rank == 1  # noqa: E731
                                    else Script(finish_after=20))
    c, world, _ = make(tmp_path, script, make_job(tmp_path, failure={"max_restarts": 1}))
    assert run_fast(c).status == "succeeded" and len(world.groups) == 2
    assert world.standby_filled == [2]  # the first attempt's; none for the second, after the one restart allowed


def preemptible(tmp_path, **failure):
    return make_job(tmp_path, checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50},
                    failure={"max_restarts": 0, **failure})


def test_a_drained_node_stops_every_worker_at_one_step_checkpoints_and_restarts_without_it(tmp_path):
    storage = Storage(str(tmp_path / "ckpt"))
    job = preemptible(tmp_path)
    c, world, clock = make(tmp_path, lambda attempt, task: Script(finish_after=30.0), job, nodes=3)
    t0 = clock.now()
    world.drains = [(t0 + 6.1, "node-1", t0 + 36.1)]  # rank 1's node, a 30-s deadline, between two polls
    world.on_checkpoint = lambda step: _checkpoints(tmp_path, [step]) and None
    result = run_fast(c)
    assert result.status == "succeeded"  # max_restarts 0: a preemption is not charged
    (ranks, step), = world.stop_requests
    assert ranks == [0, 1] and step > 60  # past where both were when asked (10 steps/s, ~6 s in)
    restart, = result.restarts
    assert restart["kind"] == "preempted" and restart["node_id"] == "node-1" and restart["ranks"] == [1]
    assert restart["step_saved"] == step and restart["resumed_from_step"] == step and restart["steps_lost"] == 0
    assert step == restart["stop_step"] == restart["step_at_notice"] + 5  # half a second at 10 steps/s
    # seen within Limits.drain_check_s (0.25 s) of the notice, not at the next poll (1 s)
    assert restart["deadline"] == t0 + 36.1 and 29.75 <= restart["deadline_s_after_notice"] <= 30
    assert 0 < restart["notice_to_checkpoint_s"] < 30
    assert world.payloads[-1].resume_from.step == step == storage.latest().step
    assert world.released[0] == "pg-1" and world.reservations == [2, 2]  # placed anew, off the draining node
    assert {t["node_id"] for t in result.tasks} == {"node-0", "node-2"}
    assert "node 10.0.0.2 is draining" in restart["reason"]


def test_a_drain_without_a_deadline_is_handled_the_same(tmp_path):
    c, world, clock = make(tmp_path, lambda attempt, task: Script(finish_after=30.0), preemptible(tmp_path), nodes=3)
    world.drains = [(clock.now() + 3.0, "node-0", None)]
    result = run_fast(c)
    restart, = result.restarts
    assert restart["kind"] == "preempted" and restart["deadline"] is None and restart["step_saved"] is not None


def test_a_drained_node_the_job_does_not_use_changes_nothing(tmp_path):
    c, world, clock = make(tmp_path, lambda attempt, task: Script(finish_after=20.0), preemptible(tmp_path), nodes=3)
    world.drains = [(clock.now() + 3.0, "node-2", clock.now() + 30.0)]
    result = run_fast(c)
    assert result.restarts == [] and world.stop_requests == [] and len(world.groups) == 1


def test_a_deadline_shorter_than_a_checkpoint_falls_back_to_the_last_one_at_once(tmp_path):
    _checkpoints(tmp_path, [50])
    script = lambda attempt, task: Script(finish_after=30.0, checkpoint_s=8.0)  # noqa: E731
    c, world, clock = make(tmp_path, script, preemptible(tmp_path), nodes=3, resume=True)
    world.drains = [(clock.now() + 6.0, "node-1", clock.now() + 16.0)]  # 10 s left, a checkpoint takes 8
    result = run_fast(c)
    restart, = result.restarts
    assert world.stop_requests == [] and restart["step_saved"] is None and restart["resumed_from_step"] == 50
    assert "too short for a checkpoint (the last took 8.0s)" in restart["reason"]


def test_a_rank_already_past_the_stop_step_falls_back_and_the_node_going_first_is_still_a_preemption(tmp_path):
    c, world, clock = make(tmp_path, lambda attempt, task: Script(finish_after=30.0), preemptible(tmp_path), nodes=3)
    world.drains = [(clock.now() + 6.0, "node-1", clock.now() + 36.0)]
    world.refuse_stop = {1}
    result = run_fast(c)
    restart, = result.restarts
    assert restart["kind"] == "preempted" and "rank(s) [1] could not stop at step" in restart["reason"]
    assert restart["step_saved"] is None and restart["steps_lost"] > 0  # back to the start: no checkpoint yet

    def dies(attempt, task):  # the node goes before the step is reached (1 step/s: the stop is >= 2 s away)
        if attempt == 1:
            return Script(fail_after=7.5, error=actor_died(), steps_per_s=1.0) if task.rank == 1 else \
                Script(finish_after=30, steps_per_s=1.0)
        return Script(finish_after=30)

    c, world, clock = make(tmp_path / "2", dies, preemptible(tmp_path / "2"), nodes=3)
    world.drains = [(clock.now() + 6.0, "node-1", clock.now() + 8.0)]
    result = run_fast(c)
    restart, = result.restarts
    assert restart["kind"] == "preempted" and "actor died" in restart["cause"] and restart["step_saved"] is None
    assert result.status == "succeeded"


def test_an_error_in_the_users_code_during_a_notice_still_ends_the_job(tmp_path):
    def fails(attempt, task):  # rank 0's code raises while the drain notice is being served
        return Script(fail_after=7.5, error=user_error("ValueError: bad shape"), steps_per_s=1.0) \
            if task.rank == 0 else Script(finish_after=30, steps_per_s=1.0)

    c, world, clock = make(tmp_path, fails, preemptible(tmp_path, max_restarts=3), nodes=3)
    world.drains = [(clock.now() + 6.0, "node-1", clock.now() + 36.0)]
    with pytest.raises(TrainingFailed, match="bad shape"):
        run_fast(c)
    assert world.stop_requests and len(world.groups) == 1  # the notice was being served; no restart


def test_under_parameter_servers_a_drained_node_with_only_a_worker_is_let_go(tmp_path):
    job = make_job(tmp_path, strategy="parameter_server", checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50},
                   cluster={"workers": 2, "ps": 1, "cpus_per_worker": 0.5}, failure={"max_restarts": 0})

    def script(attempt, task):  # chief on node-0, ps on node-1, worker 0 on node-2, worker 1 on node-0
        if task.role == "chief":
            return Script(finish_after=20.0)
        if task.role == "worker" and task.index == 0 and attempt == 1:
            return Script(finish_after=None, fail_after=9.0, error=actor_died())  # its node goes
        return Script(finish_after=None)

    c, world, clock = make(tmp_path, script, job, nodes=3)
    world.drains = [(clock.now() + 3.0, "node-2", clock.now() + 30.0)]
    result = run_fast(c)
    assert result.status == "succeeded" and result.restarts == [] and world.stop_requests == []
    assert world.replaced == [2] and len(world.groups) == 1  # worker 0 replaced; the attempt went on


def test_without_a_checkpoint_dir_a_drain_is_only_reported(tmp_path):
    c, world, clock = make(tmp_path, lambda attempt, task: Script(finish_after=20.0), make_job(tmp_path), nodes=3)
    world.drains = [(clock.now() + 3.0, "node-1", None)]
    result = run_fast(c)
    assert result.restarts == [] and world.stop_requests == []


def test_a_512_rank_attempt_steps_through_to_done(tmp_path):
    """64 nodes x 8 GPUs' worth of workers (benchmarks/bench_scale.py times it): one attempt, every rank placed,
    named and reported, well under a second."""
    job = make_job(tmp_path, train={"global_batch_size": 512 * 8},
                   cluster={"workers": 512, "cpus_per_worker": 1, "gpus_per_worker": 1, "reserve_timeout_s": 60})
    c, world, _ = make(tmp_path, lambda attempt, task: Script(finish_after=20.0), job)
    result = run_fast(c)
    assert result.status == "succeeded" and [t["rank"] for t in result.tasks] == list(range(512))
    assert len({t["address"] for t in result.tasks}) == 512 and len(set(world.groups[0].names.values())) == 512


def test_the_driver_side_imports_neither_ray_nor_tensorflow():
    """The controller, the policies, the backends and the spec in a fresh interpreter."""
    code = textwrap.dedent("""
        import sys
        import raytf, raytf.cli, raytf.spec, raytf.driver.controller, raytf.driver.policy, raytf.backends, raytf.rendezvous
        import raytf.driver.failure, raytf.driver.report, raytf.sweep, raytf.driver.quiet
        print(sorted(m for m in ("tensorflow", "keras", "ray") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_a_train_fn_that_reported_nothing_and_saved_no_model_is_told_how(tmp_path):
    import io

    from raytf.driver.report import ProgressDisplay

    shown = io.StringIO()
    job = make_job(tmp_path, model=None, train_fn="tmodel:train")
    clock = FakeClock()
    world = FakeResources(clock, lambda attempt, task: Script(outcome={"history": []}))
    c = Controller(job, world, code=None, clock=clock, display=ProgressDisplay(stream=shown))
    assert run_fast(c).status == "succeeded"
    said = shown.getvalue()
    assert "the train_fn reported no epoch: call ctx.report(metrics)" in said, said
    assert "the train_fn saved no model: call ctx.save_model(model)" in said


def test_a_free_form_config_section_reaches_the_train_fns_ctx():
    from raytf.actor.context import TaskContext

    spec = parse(base_spec(model=None, train_fn="tmodel:train", config={"lr": 0.1, "layers": [64, 32]}))
    ctx = TaskContext(0, 2, spec, "/nonexistent")
    assert ctx.config == {"lr": 0.1, "layers": [64, 32]}
    assert parse(base_spec()).config == {}


# ---------------------------------------------------------------- a sweep's trials in one process (raytf.actor.reuse)


def _trial(tmp_path, world, clock, name, callbacks=(), **sections):
    job = make_job(tmp_path / name, **sections)
    return Controller(job, world, code=None, clock=clock, placement_group="trial-pg", callbacks=callbacks)


def test_a_sweep_trial_runs_in_the_last_trials_processes_when_they_match_and_only_then(tmp_path):
    clock = FakeClock()
    world = FakeResources(clock, lambda attempt, task: Script(finish_after=6.0))
    world.keep_processes = True
    first = run_fast(_trial(tmp_path, world, clock, "a"))
    assert first.processes_reused == 0 and world.kept is not None and not world.groups[0].stopped
    second = run_fast(_trial(tmp_path, world, clock, "b", train={"global_batch_size": 64, "epochs": 1}))
    assert second.status == "succeeded" and second.processes_reused == 2
    assert len(world.groups) == 1, "no new actors: the kept ones were set up again"
    assert [t["address"] for t in second.tasks] == [t["address"] for t in first.tasks], "the same TF_CONFIG"
    # other threads per worker: TensorFlow's thread pools are fixed for a process's life; new processes
    third = run_fast(_trial(tmp_path, world, clock, "c", cluster={"workers": 2, "cpus_per_worker": 2}))
    assert third.processes_reused == 0 and len(world.groups) == 2 and world.groups[0].stopped
    # a parameter-server job never keeps its processes
    world.kept = None
    run_fast(_trial(tmp_path, world, clock, "ps", strategy="parameter_server", cluster={"workers": 2, "ps": 1}))
    assert world.kept is None and world.kept_asked[-1] is None


def test_kept_processes_that_do_not_start_again_are_replaced_at_no_cost_and_a_restart_takes_none(tmp_path):
    clock = FakeClock()
    world = FakeResources(clock, lambda attempt, task: (Script(finish_after=None, fail_after=3.0, error=actor_died())
                                                        if attempt == 2 and task.rank == 1 else Script(finish_after=6.0)))
    world.keep_processes = True
    run_fast(_trial(tmp_path, world, clock, "a"))
    world.kept_fails_setup = "TensorFlow's server is gone"
    c = _trial(tmp_path, world, clock, "b", failure={"max_restarts": 1})
    result = run_fast(c)
    assert result.status == "succeeded" and result.processes_reused == 0
    assert world.groups[0].stopped and len(world.groups) == 3, "kept (failed setup), new, then the restart's"
    assert [r["kind"] for r in result.restarts] == ["actor_died"], "only the real failure was charged"
    assert result.rendezvous_attempts == 1
    assert world.kept_asked[-1] is None, "a restart does not look for a kept group"


def test_a_trial_stopped_by_its_last_report_or_on_a_draining_node_keeps_no_processes(tmp_path):
    """Tune may stop a trial in the report of its last epochs, fed after the workers returned: the job did
    not end well, so its workers go. Nor are workers kept on a node being drained."""
    clock = FakeClock()
    world = FakeResources(clock, lambda attempt, task: Script(finish_after=6.0))
    world.keep_processes = True

    class StoppedByTune(Callback):
        def on_epoch(self, metrics):  # tune.report raises SystemExit in a trial Tune stops; raytf's report says why
            raise TrialStopped(f"stopped early by tune.scheduler asha after epoch {metrics['epoch']}")

    stopped = _trial(tmp_path, world, clock, "a", callbacks=[StoppedByTune()])
    with pytest.raises(SystemExit):
        stopped.run()
    assert world.kept is None and world.groups[0].stopped
    written = json.loads((stopped.job.output_dir / "result.json").read_text())
    assert written["status"] == "stopped" and written["error"] == "stopped early by tune.scheduler asha after epoch 1"
    assert written["history"], "the epochs before the stop are kept"
    c = _trial(tmp_path, world, clock, "b")
    while c.state != DONE:
        c.step()
    world.drains.append((0.0, "node-0", None))  # a notice for a node the job ran on, as it ends
    c.run()
    assert world.kept is None and world.groups[1].stopped
    world.drains.clear()
    run_fast(_trial(tmp_path, world, clock, "c"))
    assert world.kept is not None and not world.groups[2].stopped
