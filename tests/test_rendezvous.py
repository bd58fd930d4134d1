"""Rank assignment and TF_CONFIG are pure: tested on fake actor reports."""
import json

import pytest

from raytf.rendezvous import ActorLocation, assign_ranks, assign_roles, cluster_spec, placed, tf_config, tf_configs


def report(bundle, node, port=1000, gpus=(), ip=None):
    return ActorLocation(bundle_index=bundle, node_id=node, node_ip=ip or f"10.0.0.{node[-1]}", port=port + bundle,
                       gpu_ids=tuple(gpus))


def test_actors_on_one_node_get_adjacent_ranks_and_the_first_bundles_node_is_rank_0():
    reports = [report(0, "n1"), report(1, "n2"), report(2, "n1"), report(3, "n2")]
    tasks = assign_ranks(reports)
    assert [t.rank for t in tasks] == [0, 1, 2, 3]
    assert [t.node_id for t in tasks] == ["n1", "n1", "n2", "n2"]
    assert [t.bundle_index for t in tasks] == [0, 2, 1, 3]


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]])
def test_ranks_do_not_depend_on_the_order_reports_arrive(order):
    reports = [report(0, "a", gpus=["1"]), report(1, "b", gpus=["0"]), report(2, "a", gpus=["0"]),
               report(3, "b", gpus=["1"])]
    tasks = assign_ranks([reports[i] for i in order])
    assert [(t.node_id, t.bundle_index, t.gpu_ids) for t in tasks] == [
        ("a", 0, ("1",)), ("a", 2, ("0",)), ("b", 1, ("0",)), ("b", 3, ("1",))]


def test_ranks_planned_from_the_placement_alone_are_the_ranks_the_actors_get():
    """Actors are named at creation, before they report: the plan from bundle -> node must agree with the
    ranks assigned once they report (GPU ids, addresses and ports included)."""
    nodes = {0: "a", 1: "b", 2: "a", 3: "c", 4: "b"}
    reports = [report(b, n, gpus=[str(4 - b)]) for b, n in nodes.items()]
    planned = assign_ranks(placed(nodes))
    real = assign_ranks(list(reversed(reports)))
    assert [(t.rank, t.bundle_index) for t in planned] == [(t.rank, t.bundle_index) for t in real]
    roles = ["chief", "ps", "worker", "worker", "evaluator"]
    assert [(t.role, t.index) for t in assign_roles(placed(nodes), roles)] == [
        (t.role, t.index) for t in assign_roles(reports, roles)]


def test_duplicate_bundles_are_rejected():
    with pytest.raises(ValueError, match="duplicate bundle"):
        assign_ranks([report(0, "a"), report(0, "b")])


def test_tf_config_lists_every_worker_by_rank_and_names_this_task():
    tasks = assign_ranks([report(0, "n1", port=5000), report(1, "n2", port=6000)])
    for task in tasks:
        config = json.loads(tf_config(tasks, task))
        assert config["cluster"] == {"worker": ["10.0.0.1:5000", "10.0.0.2:6001"]}
        assert config["task"] == {"type": "worker", "index": task.rank}


def test_ipv6_addresses_are_bracketed():
    tasks = assign_ranks([report(0, "n1", port=5000, ip="fe80::1")])
    assert cluster_spec(tasks) == {"worker": ["[fe80::1]:5000"]}


def test_parameter_server_roles_follow_bundle_order_and_the_evaluator_stays_out_of_tfs_cluster():
    roles = ["chief", "ps", "ps", "worker", "worker", "worker", "evaluator"]
    reports = [report(b, "n1" if b % 2 else "n2") for b in range(len(roles))]
    tasks = assign_roles(list(reversed(reports)), roles)
    assert [(t.rank, t.role, t.index) for t in tasks] == [
        (0, "chief", 0), (1, "ps", 0), (2, "ps", 1), (3, "worker", 0), (4, "worker", 1), (5, "worker", 2),
        (6, "evaluator", 0)]
    spec = cluster_spec(tasks)
    assert set(spec) == {"chief", "ps", "worker"} and len(spec["worker"]) == 3
    assert spec["ps"] == [tasks[1].address, tasks[2].address]
    config = json.loads(tf_config(tasks, tasks[4]))
    assert config["task"] == {"type": "worker", "index": 1} and "evaluator" not in config["cluster"]
    with pytest.raises(ValueError, match="do not match the 3 roles"):
        assign_roles(reports[:2], roles[:3])
    with pytest.raises(ValueError, match="first bundle must be the one chief"):
        assign_roles(reports[:2], ["ps", "chief"])


def test_a_64_node_by_8_gpu_placement_plans_512_ranks_node_by_node():
    """The scale of `benchmarks/bench_scale.py`: nodes in no particular order, 8 bundles each."""
    import random

    order = list(range(64))
    random.Random(1).shuffle(order)
    bundle_nodes = {i: f"node-{order[i // 8]:02d}" for i in range(512)}
    ip = {f"node-{n:02d}": f"10.0.{n}.1" for n in range(64)}
    reports = [ActorLocation(bundle_index=i, node_id=n, node_ip=ip[n], port=20000 + i) for i, n in bundle_nodes.items()]
    random.Random(2).shuffle(reports)  # as they report in
    tasks = assign_ranks(reports)
    planned = assign_ranks(placed(bundle_nodes))
    assert [(t.rank, t.bundle_index) for t in tasks] == [(t.rank, t.bundle_index) for t in planned]
    assert tasks[0].bundle_index == 0
    for node in set(bundle_nodes.values()):  # each node's 8 ranks are adjacent
        ranks = sorted(t.rank for t in tasks if t.node_id == node)
        assert ranks == list(range(ranks[0], ranks[0] + 8))
    configs = tf_configs(tasks)
    assert configs == [tf_config(tasks, t) for t in tasks]
    workers = json.loads(configs[511])["cluster"]["worker"]
    assert len(set(workers)) == 512 and workers == [t.address for t in tasks]
    assert json.loads(configs[511])["task"] == {"type": "worker", "index": 511}
