"""Failure classification and the restart policy are pure."""
import pytest

from raytf.driver.failure import (
    Failure,
    RankError,
    aggregate,
    classify,
)
from raytf.driver.policy import RestartPolicy, checkpoint_fits, elastic_batch, elastic_sizes, stop_step
from raytf.job import parse


def test_classify_tells_infrastructure_from_user_errors():
    assert classify("RayActorError", "died", actor_died=True) == "actor_died"
    assert classify("UnavailableError", "peer gone") == "collective"
    assert classify("InternalError", "Collective ops is aborted") == "collective"
    assert classify("ConnectionResetError", "") == "io"
    assert classify("ValueError", "bad shape") == "error"


def test_a_dead_actor_is_the_root_cause_of_its_peers_collective_errors():
    failure = aggregate([RankError(0, "collective", "UnavailableError: peer 1 unreachable"),
                         RankError(2, "collective", "UnavailableError: peer 1 unreachable"),
                         RankError(1, "actor_died", "actor died (killed)")])
    assert failure.kind == "actor_died" and failure.ranks == (1,)
    assert failure.message == ("rank(s) 1: actor died (killed); "
                               "then rank(s) 0, 2: UnavailableError: peer 1 unreachable")


def test_identical_errors_are_grouped_by_rank():
    failure = aggregate([RankError(r, "error", "ValueError: boom") for r in (3, 1, 2)])
    assert failure.causes == {"ValueError: boom": [1, 2, 3]} and failure.message.startswith("rank(s) 1, 2, 3")


@pytest.mark.parametrize("kind,done,allowed,restart", [
    ("actor_died", 0, 2, True), ("hang", 1, 2, True), ("collective", 2, 2, False),
    ("error", 0, 5, False), ("startup", 0, 0, False),
])
def test_the_restart_policy(kind, done, allowed, restart):
    failure = Failure(kind=kind, message="m", ranks=(0,), causes={})
    assert (RestartPolicy(allowed).decide(failure, done).action == "restart") is restart


def test_a_corrupt_checkpoint_is_a_free_restart():
    decision = RestartPolicy(0).decide(Failure(kind="checkpoint", message="m", ranks=(0,), causes={}), 0)
    assert decision.action == "restart" and decision.charged is False


def elastic_spec(workers, batch, accumulation=1, gpus=0.0):
    return parse({"name": "e", "model": "m:f", "dataset_fn": "m:d",
                  "train": {"global_batch_size": batch, "accumulation_steps": accumulation, "steps_per_epoch": 10},
                  "cluster": {"workers": workers, "gpus_per_worker": gpus}})


def test_elastic_sizes_are_those_that_keep_the_effective_batch():
    assert elastic_sizes(elastic_spec(4, 96), 2) == [4, 3, 2]
    assert elastic_sizes(elastic_spec(4, 64), 1) == [4, 2, 1]  # 3 workers: 4/3 accumulation, 64/3 rows
    assert elastic_sizes(elastic_spec(4, 32, accumulation=3), 1) == [4, 3, 2, 1]  # 3: 4 steps of 24
    assert elastic_sizes(elastic_spec(3, 63), 3) == [3]


def test_an_elastic_restart_raises_accumulation_before_it_grows_the_per_replica_batch():
    spec = elastic_spec(4, 64, accumulation=2)  # 16 rows per replica, effective batch 128
    assert elastic_batch(spec, 4).to_dict() == {"global_batch_size": 64, "accumulation_steps": 2,
                                                "per_replica_batch_size": 16, "kept": "as_asked"}
    halved = elastic_batch(spec, 2)  # 4 x 2 / 2 = 4 accumulation steps of 32: same memory, same effective batch
    assert (halved.global_batch_size, halved.accumulation_steps, halved.per_replica_batch_size,
            halved.kept) == (32, 4, 16, "per_replica_batch")
    assert elastic_batch(spec, 1).accumulation_steps == 8
    three = elastic_batch(elastic_spec(4, 96), 3)  # 4/3 accumulation steps do not divide: 32 rows per replica
    assert (three.global_batch_size, three.accumulation_steps, three.per_replica_batch_size,
            three.kept) == (96, 1, 32, "global_batch")
    assert elastic_batch(elastic_spec(4, 64), 3) is None
    gpus = elastic_batch(elastic_spec(4, 64, gpus=2), 2)  # 8 replicas of 8 rows -> 4 replicas, 2 steps
    assert (gpus.global_batch_size, gpus.accumulation_steps, gpus.per_replica_batch_size) == (32, 2, 8)
    for spec, workers in [(elastic_spec(4, 64, 2), 2), (elastic_spec(4, 96), 3), (elastic_spec(4, 32, 3), 1)]:
        plan = elastic_batch(spec, workers)
        assert plan.global_batch_size * plan.accumulation_steps == spec.train.effective_batch_size


def test_error_summaries_keep_the_line_that_names_the_cause():
    from raytf.actor.raised import summary

    assert summary("FileNotFoundError: no such file\n\t [[{{node IteratorGetNext}}]]") == \
        "FileNotFoundError: no such file"
    tf_error = ("Graph execution error:\n\nDetected at node loss defined at (most recent call last):\n"
                "  File \"job.py\", line 3, in f\n\nIncompatible shapes: [16,10] vs. [16]\n"
                "\t [[{{node loss}}]] [Op:__inference_train_1]")
    assert summary(tf_error) == "Incompatible shapes: [16,10] vs. [16]"
    assert summary("x" * 900) == "x" * 500


def test_after_the_held_group_waited_in_vain_the_full_size_gets_the_short_wait():
    from raytf.driver.policy import Limits, ScalingPolicy

    def spec(elastic):
        return parse({"name": "e", "model": "m:f", "dataset_fn": "m:d",
                      "train": {"global_batch_size": 96, "steps_per_epoch": 10},
                      "cluster": {"workers": 4, "reserve_timeout_s": 60},
                      "failure": {"elastic": {"min_workers": 2} if elastic else None}})

    limits = Limits(elastic_reserve_timeout_s=10.0)
    policy = ScalingPolicy(spec(elastic=True), limits, elastic_supported=True)
    assert policy.sizes(after_failure=True) == [(4, 60.0), (3, 10.0), (2, 10.0)]
    assert policy.sizes(after_failure=True, full_size_waited=True) == [(4, 10.0), (3, 10.0), (2, 10.0)]
    assert ScalingPolicy(spec(elastic=False), limits, True).sizes(True, full_size_waited=True) == [(4, 60.0)]


def test_the_stop_step_is_past_the_furthest_rank_by_the_margin_and_at_least_two_steps_and_never_an_epochs_last():
    assert stop_step([100, 104], 20.0, 0.5) == 114  # 10 steps of travel at 20 steps/s
    assert stop_step([100, 104], 1.0, 0.5) == 106  # slow steps: still two ahead
    assert stop_step([7], None, 0.5) == 17  # no rate measured yet
    # an epoch's last step is passed by one: a train_fn's report of that epoch comes after it
    assert stop_step([80], None, 0.5, steps_per_epoch=90) == 90 + 1
    assert stop_step([80], None, 0.5, steps_per_epoch=89) == 90


def test_a_checkpoint_fits_when_the_way_to_the_stop_and_two_saves_fit_before_the_deadline():
    assert checkpoint_fits(None, 5.0, 1.0) and checkpoint_fits(3.0, None, 1.0)  # nothing to compare: try
    assert checkpoint_fits(12.0, 5.0, 0.5)  # 0.5 + 2 x 5 + 1 = 11.5 < 12
    assert not checkpoint_fits(12.0, 5.0, 2.0)  # slow steps: the way to the stop takes 2 s


def test_a_known_cause_gets_its_fix_in_the_first_line_and_small_numbers_keep_their_digits():
    from raytf.actor.raised import summary, with_fix
    from raytf.driver.report import fmt

    said = summary(with_fix("'ShardedVariable' object has no attribute 'handle'\nTraceback ..."))
    assert said.startswith("'ShardedVariable' object has no attribute 'handle' (Keras 3 optimizers cannot update")
    assert "train.keras: legacy" in said and with_fix("some other error") == "some other error"
    assert fmt(1e-05) == "1.00e-05" and fmt(0.25) == "0.2500" and fmt(0.0) == "0.0000"


def test_a_sentence_keras_wraps_over_lines_is_kept_whole_in_the_one_line_error():
    from raytf.actor.raised import summary

    wrapped = ("Object RecommenderNet was created by passing\nnon-serializable argument values in `__init__()`,\n"
               "and therefore the object must override `get_config()` in\norder to be serializable. Please implement "
               "`get_config()`.\n\nExample:\n")
    assert summary(wrapped).endswith("must override `get_config()` in order to be serializable. Please implement "
                                     "`get_config()`.")
    assert summary("bad shape (2, 3)\nValueError: more") == "bad shape (2, 3)"
    assert summary("one line\nAnother sentence") == "one line"


# ---------------------------------------------------------------- a hang, named (raytf.actor.stacks)

SITE = "/usr/lib/python3.11/site-packages"
RAYTF_LOOP = __import__("raytf.actor.loop", fromlist=["x"]).__file__
THREADING = __import__("threading").__file__  # this Python's own library
UPLOADS = __import__("raytf.actor.uploads", fromlist=["x"]).__file__


@pytest.mark.parametrize("innermost, expected", [
    # stuck in the user's own code: its line
    ([("/job/stall.py", 15, "gen", "time.sleep(3600)")], ("user code", "stall.py:15 in gen")),
    # an all-reduce waits inside TensorFlow's execution of the step raytf's loop called
    ([(f"{SITE}/tensorflow/python/eager/execute.py", 53, "quick_execute", "")],
     ("a TensorFlow step or collective", "loop.py:90 in run")),
    # a checkpoint upload stuck in pyarrow's file system
    ([(f"{SITE}/raytf_storage_shim.py", 1, "x", ""), (f"{SITE}/pyarrow/fs.py", 300, "open_output_stream", "")],
     ("storage I/O", "fs.py:300 in open_output_stream")),
    # the chief's next checkpoint waits for the one before still uploading in the background
    ([(UPLOADS, 62, "_wait", ""), (THREADING, 1119, "join", "")], ("storage I/O", "uploads.py:62 in _wait")),
    # waiting for the next batch from tf.data
    ([(f"{SITE}/tensorflow/python/data/ops/iterator_ops.py", 800, "get_next", "")],
     ("input", "loop.py:90 in run")),
    # a wait in Python's library says nothing: the raytf line that waits does
    ([(THREADING, 320, "wait", "")], ("raytf", "loop.py:90 in run")),
])
def test_what_a_stuck_rank_is_doing_is_read_from_its_innermost_telling_frame(innermost, expected):
    from raytf.actor import stacks

    outer = [(THREADING, 1000, "run", ""), (RAYTF_LOOP, 90, "run", "")]
    assert stacks.doing(outer + innermost) == expected


def test_a_snapshot_finds_the_training_thread_in_the_users_code_and_says_it_per_rank():
    import threading

    from raytf.actor import stacks
    from raytf.driver import hangs

    stuck, started = threading.Event(), []

    def train_fn():  # this test file stands in for the user's
        started.append(threading.get_ident())
        stuck.wait(30)

    thread = threading.Thread(target=train_fn, name="train")
    thread.start()
    while not started:
        pass
    try:
        threads = stacks.snapshot(started[0])
    finally:
        stuck.set()
        thread.join()
    doing, where, _ = stacks.summary(threads)
    assert doing == "user code" and where.startswith("test_failure.py:") and where.endswith("in train_fn"), where
    assert threads[0]["training"] and "stuck.wait(30)" in stacks.text(threads[:1])
    answer = {"doing": doing, "where": where, "others": [], "text": "..."}
    assert hangs.lines([None, answer], [1], {0: "chief", 1: "worker"}) == [
        "rank 0 (chief): did not answer within 5s (its process is gone, or holds Python's lock)",
        f"rank 1 (worker, no progress): user code at {where}"]


def test_a_hang_report_never_overwrites_an_earlier_one_and_a_new_run_moves_them_aside(tmp_path):
    """A resumed run counts its attempts from 1 again: its report goes beside the first, not over it."""
    from raytf.driver import hangs
    from raytf.driver.output import RESULTS

    answer = {"doing": "user code", "where": "x.py:1 in f", "others": [], "text": "stack"}
    first = hangs.write(tmp_path, 1, [answer], ["rank 0 (chief): first"])
    again = hangs.write(tmp_path, 1, [answer], ["rank 0 (chief): again"])
    assert (first, again) == ("hangs/attempt-1", "hangs/attempt-1-1")
    assert (tmp_path / first / "rank-0.txt").read_text().startswith("rank 0 (chief): first")
    assert "hangs" in RESULTS  # an earlier run's reports go to earlier-runs/ with its other results


def test_the_survivor_that_got_furthest_is_rescued_and_none_that_is_no_further_than_the_last_checkpoint():
    from raytf.driver.rescue import best

    assert best({0: 29, 1: 30, 2: None}, after_step=10) == (1, 30)  # the furthest
    assert best({0: 30, 1: 30}, after_step=10) == (0, 30)  # the lowest rank among equals
    assert best({0: 10, 1: None}, after_step=10) is None  # no further than the newest checkpoint
    assert best({}, after_step=0) is None

