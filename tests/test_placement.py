"""The shortage message says what was asked, what the cluster has, and what to change; whether a cluster that
cannot grow (an embedded local Ray) can ever hold a request."""
import pytest

from raytf.driver.placement import shortage_message, worker_bundles
from raytf.spec import ClusterSpec


def test_one_bundle_per_worker_without_zero_resources():
    assert worker_bundles(ClusterSpec(workers=3, cpus_per_worker=2, gpus_per_worker=0)) == [{"CPU": 2.0}] * 3
    assert worker_bundles(ClusterSpec(workers=2, cpus_per_worker=1, gpus_per_worker=1)) == [{"CPU": 1.0, "GPU": 1.0}] * 2


def test_missing_gpus_are_named_with_what_the_cluster_has():
    msg = shortage_message([{"CPU": 1, "GPU": 4}] * 2, "PACK", 5, {"CPU": 4, "GPU": 2}, {"CPU": 4, "GPU": 2},
                           [{"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}])
    assert "asked for 2 bundles of {CPU: 1, GPU: 4}" in msg
    assert "total {CPU: 2, GPU: 8}" in msg
    assert "the cluster has {CPU: 4, GPU: 2} in 2 node(s)" in msg
    assert "lacks GPU" in msg and "lower cluster.workers" in msg


def test_a_bundle_bigger_than_any_node_is_explained():
    msg = shortage_message([{"CPU": 3}] * 2, "SPREAD", 5, {"CPU": 8}, {"CPU": 8}, [{"CPU": 2}] * 4)
    assert "No single node has the CPU one bundle needs" in msg


def test_strict_spread_over_too_few_nodes_suggests_pack():
    msg = shortage_message([{"CPU": 1}] * 3, "STRICT_SPREAD", 5, {"CPU": 8}, {"CPU": 8}, [{"CPU": 4}] * 2)
    assert "STRICT_SPREAD cannot be met" in msg and "placement: pack" in msg


def test_strict_spread_that_these_nodes_could_hold_is_not_called_impossible():
    # seen in CI: one node unreachable (its cable pulled) but not yet declared dead, the other holding bundle 1
    msg = shortage_message([{"CPU": 1, "GPU": 1}] * 2, "STRICT_SPREAD", 5, {"CPU": 3, "GPU": 4}, {"CPU": 2, "GPU": 3},
                           [{"CPU": 1}, {"CPU": 1, "GPU": 2}, {"CPU": 1, "GPU": 2}])
    assert "cannot be met" not in msg and "busy" in msg and "cluster.reserve_timeout_s" in msg


def test_busy_cluster_says_so():
    msg = shortage_message([{"CPU": 1}] * 2, "PACK", 5, {"CPU": 2}, {"CPU": 0}, [{"CPU": 2}])
    assert "busy" in msg and "{CPU: 0} available now" in msg


def test_a_parameter_server_job_has_a_chief_ps_and_worker_bundles_in_that_order():
    from raytf.driver.placement import bundle_roles, job_bundles
    from raytf.job import parse
    from tests.conftest import base_spec

    spec = parse(base_spec(strategy="parameter_server",
                           cluster={"workers": 2, "ps": 2, "cpus_per_ps": 2, "cpus_per_chief": 0.5,
                                    "gpus_per_worker": 1, "cpus_per_worker": 1, "evaluator": True},
                           checkpoint={"dir": "ckpt"}))
    assert bundle_roles(spec) == ["chief", "ps", "ps", "worker", "worker", "evaluator"]
    assert job_bundles(spec) == [{"CPU": 0.5}, {"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0},
                                 {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    mirrored = parse(base_spec())
    assert bundle_roles(mirrored) == ["worker", "worker"] and job_bundles(mirrored) == [{"CPU": 0.5}] * 2
    # a shortage of mixed bundles lists each shape
    msg = shortage_message(job_bundles(spec), "PACK", 5, {"CPU": 4}, {"CPU": 4}, [{"CPU": 4}])
    assert "asked for 6 bundles (1 x {CPU: 0.5}, 2 x {CPU: 2}, 3 x {CPU: 1, GPU: 1}; total {CPU: 7.5, GPU: 3}" in msg
    assert "It lacks CPU, GPU" in msg


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bundles,strategy,nodes,fits", [
    ([{"CPU": 64}] * 2, "PACK", [{"CPU": 2}], False),  # a bundle bigger than the node
    ([{"CPU": 1.5}] * 2, "PACK", [{"CPU": 2}], False),  # each bundle fits, the two together do not
    ([{"CPU": 0.5}] * 2, "PACK", [{"CPU": 2, "memory": 1e9, "node:10.0.0.1": 1}], True),
    ([{"CPU": 0.5}] * 2, "STRICT_SPREAD", [{"CPU": 2}], False),  # a node per bundle
    ([{"CPU": 0.5}] * 2, "STRICT_SPREAD", [{"CPU": 1}, {"CPU": 1}], True),
    ([{"CPU": 1}] * 2, "STRICT_PACK", [{"CPU": 1}, {"CPU": 1}], False),  # all on one node
    ([{"CPU": 1}] * 2, "SPREAD", [{"CPU": 1}, {"CPU": 1}], True),
    ([{"CPU": 0.5, "GPU": 1}], "PACK", [{"CPU": 2}], False),  # no GPU at all
])
def test_whether_a_cluster_that_cannot_grow_can_ever_hold_the_bundles(bundles, strategy, nodes, fits):
    from raytf.driver.placement import can_ever_hold

    assert can_ever_hold(nodes, bundles, strategy) is fits
    assert nodes[0].get("CPU") in (1, 2)  # the nodes given are not used up


@pytest.mark.timeout(10)
def test_an_embedded_ray_says_at_once_what_was_asked_what_it_has_and_the_fix():
    msg = shortage_message([{"CPU": 64}] * 2, "PACK", 120, {"CPU": 2}, {"CPU": 2}, [{"CPU": 2}], embedded=True)
    assert msg.startswith("the embedded local Ray (this machine only; it cannot grow) can never hold")
    assert "after 120s" not in msg  # it did not wait
    assert "asked for 2 bundles of {CPU: 64} (total {CPU: 128}" in msg and "the cluster has {CPU: 2} in 1 node(s)" in msg
    assert "lower cluster.workers or the per-worker resources, or run on a Ray cluster that has them (--address)" in msg
