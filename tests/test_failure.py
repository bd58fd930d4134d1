"""Failure classification and the restart policy are pure."""
import pytest

from raytf.driver.failure import (
    Failure,
    RankError,
    aggregate,
    classify,
    elastic_sizes,
)
from raytf.driver.policy import RestartPolicy


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


def test_elastic_sizes_keep_the_global_batch_divisible():
    assert elastic_sizes(4, 2, 96, 1) == [4, 3, 2]
    assert elastic_sizes(4, 1, 64, 1) == [4, 2, 1]
    assert elastic_sizes(3, 3, 64, 1) == []


def test_error_summaries_keep_the_line_that_names_the_cause():
    from raytf.driver.ray_group import summary

    assert summary("FileNotFoundError: no such file\n\t [[{{node IteratorGetNext}}]]") == \
        "FileNotFoundError: no such file"
    tf_error = ("Graph execution error:\n\nDetected at node loss defined at (most recent call last):\n"
                "  File \"job.py\", line 3, in f\n\nIncompatible shapes: [16,10] vs. [16]\n"
                "\t [[{{node loss}}]] [Op:__inference_train_1]")
    assert summary(tf_error) == "Incompatible shapes: [16,10] vs. [16]"
    assert summary("x" * 500) == "x" * 300
