"""Past one machine: a head and two worker hosts, each in its own network namespace with its own address on a
private subnet, a Ray node on each (token auth on). Jobs run through the console script as a user runs them
(`raytf run` on the head, `raytf submit` from outside to the head's Jobs API); one host's cable is pulled
mid-epoch. Skipped, saying why, where network namespaces cannot be made."""
import json
import re
import shutil
import subprocess
import time

import pytest
import yaml

from tests.conftest import REPO
from tests.faults import RESCUE_FELL_BACK
from tests.netns import BIN, Hosts, why_not

REASON = why_not()
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420),
              pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")]

HEAD, W1, W2 = "head", "w1", "w2"
HOST_LOST = "a host's node was declared dead before the test touched it"


@pytest.fixture(scope="module")
def started_hosts():
    """The head (1 CPU, no GPU: the jobs' drivers) and two 1-CPU hosts with 2 logical GPUs each."""
    h = Hosts([HEAD, W1, W2], cpus={HEAD: 1, W1: 1, W2: 1}, gpus={W1: 2, W2: 2})
    try:
        h.make_network()
        h.start_ray()
        assert sorted(h.alive_nodes()) == sorted(x.address for x in h.hosts.values())
        assert h.remains() != []  # what teardown must remove is seen while it is there
        yield h
    finally:
        h.teardown()
        assert h.remains() == []


@pytest.fixture
def hosts(started_hosts):
    """The module's hosts with every node alive: one the head declared dead in an earlier test (its raylet
    missed health checks on a saturated machine, seen once in a clean-clone CI) is started again first."""
    started_hosts.restore()
    return started_hosts


@pytest.fixture
def job_folder(tmp_path):
    folder = tmp_path / "job"
    shutil.copytree(REPO / "jobs", folder, ignore=shutil.ignore_patterns("__pycache__", ".bench-*"))
    return folder


def digits(folder, **changes):
    spec = yaml.safe_load((folder / "digits.yaml").read_text())
    spec.update(train={"epochs": 3, "global_batch_size": 32, "seed": 0}, output={"dir": str(folder / "out"),
                                                                              "tensorboard": False})
    spec["cluster"] = {"workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 1, "placement": "strict_spread",
                       "reserve_timeout_s": 30}
    spec.update(changes)
    (folder / "hosts.yaml").write_text(yaml.safe_dump(spec))
    return folder / "hosts.yaml"


def raytf_run(hosts, job, timeout_s=300):
    return hosts.run(HEAD, [str(BIN / "raytf"), "run", str(job), "--address", hosts.gcs_address], timeout_s,
                     cwd=str(job.parent))


def test_submit_from_outside_runs_a_parameter_server_job_across_the_hosts(hosts, job_folder):
    spec = yaml.safe_load((job_folder / "criteo-ps.yaml").read_text())
    # 20 steps, no validation: what is asserted is where the tasks ran and how they talked, not what they learnt
    spec.update(train={**spec["train"], "epochs": 1, "steps_per_epoch": 20, "shuffle_buffer": 1024},
                output={"dir": str(job_folder / "ps-out"), "tensorboard": False})
    spec["data"]["validation"] = None
    spec["cluster"] = {**spec["cluster"], "workers": 2, "ps": 1, "cpus_per_worker": 0.5, "cpus_per_ps": 0.25,
                       "cpus_per_chief": 0.25, "placement": "spread", "reserve_timeout_s": 30}
    (job_folder / "ps-hosts.yaml").write_text(yaml.safe_dump(spec))
    submit = [str(BIN / "raytf"), "submit", str(job_folder / "ps-hosts.yaml"), "--address", hosts.jobs_address]
    # the head is another host, reached over plain http: the token is withheld unless the user opts in
    refused = subprocess.run(submit, env=hosts.env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 5 and "raytf does not send your token over plain http" in refused.stderr, (
        refused.stderr[-2000:])
    out = subprocess.run(submit + ["--allow-http-token"], env=hosts.env(), capture_output=True, text=True,
                         timeout=360)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    result = json.loads((job_folder / "ps-out" / "result.json").read_text())
    assert result["status"] == "succeeded"
    ips = {t["node_ip"] for t in result["tasks"]}
    assert len(ips) >= 2 and ips <= {h.address for h in hosts.hosts.values()}  # gRPC crossed hosts
    for task in result["tasks"]:
        assert task["address"].rsplit(":", 1)[0] == task["node_ip"]
    assert hosts.leftovers() == {"actors": 0, "placement_groups": 0}


@pytest.mark.flaky(reruns=1, only_rerun=[RESCUE_FELL_BACK, HOST_LOST])
def test_a_mirrored_job_spans_two_hosts_at_their_own_addresses_and_a_host_whose_link_goes_down_costs_no_step(
        hosts, job_folder):
    """A 2-worker job across the two hosts (one task each, at its own host's address in TF_CONFIG); the cable
    of one is pulled mid-epoch: one restart on the host left, from the state of the rank there."""
    job = digits(job_folder, train={"epochs": 4, "global_batch_size": 16, "seed": 0},
                 checkpoint={"dir": str(job_folder / "ckpt"), "every_steps": 40},
                 # no warm standbys: the restart after a host is lost reserves a new placement group
                 failure={"max_restarts": 1, "elastic": {"min_workers": 1}, "standby": False})
    spec = yaml.safe_load(job.read_text())
    spec["cluster"]["reserve_timeout_s"] = 5  # the full size, with one host gone, is not waited for long
    # The rank left alone learns of it from its collective rather than from Ray's node health checks, whose
    # verdict took from ~25 s to 62 s here: a bound on the detection, not a race with them.
    spec["cluster"]["collective_timeout_s"] = 15
    job.write_text(yaml.safe_dump(spec))
    run = subprocess.Popen(["ip", "netns", "exec", hosts.head.ns, str(BIN / "raytf"), "run", str(job), "--address",
                            hosts.gcs_address], env=hosts.env(), cwd=str(job_folder), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in run.stdout:  # pull the cable once epoch 2 is under way
            lines.append(line)
            if line.startswith("epoch 1 done"):
                time.sleep(1.0)
                down_at = time.time()
                hosts.link(W2, up=False)
                break
        else:
            lost = hosts.lost_hosts()  # before any cable was pulled: a rerun starts them again (the hosts fixture)
            pytest.fail((f"{HOST_LOST}: {lost}; " if lost else "") + "training never got going: "
                        + "".join(lines[-20:]))
        rest, _ = run.communicate(timeout=360)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, "".join(lines[-10:]) + rest[-3000:]
    ranks = next(line for line in lines if line.startswith("raytf: rank 0@"))  # the first attempt's TF_CONFIG
    addresses = dict(re.findall(r"rank (\d)@([\d.]+):\d+", ranks))
    assert sorted(addresses.values()) == sorted([hosts.hosts[W1].address, hosts.hosts[W2].address]), ranks
    result = json.loads((job_folder / "out" / "result.json").read_text())
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]
    restart, = result["restarts"]
    detected_s = restart["time"] - down_at
    print(f"link down -> attempt failed: {detected_s:.1f}s ({restart['kind']}: {restart['reason'][:120]}); "
          f"training again after {restart['first_step_at'] - down_at:.1f}s")
    # Found by the collective timeout (15 s) when a collective is in flight as the cable goes; otherwise by Ray's
    # node health checks (~60 s: seen once in 3 CI runs, 62 s). Either way well before failure.hang_timeout_s (300 s).
    assert detected_s < 90
    assert restart["kind"] in ("collective", "actor_died", "hang") and restart["workers"] == 1
    if restart["kind"] != "hang":  # the rank left kept its state when its collective broke: nothing trained again
        notes = [line for line in rest.splitlines() if re.match(r"raytf: (rank \d+ |no survivor)", line)]
        # the message a str: pytest cuts a long repr short, and the rerun (RESCUE_FELL_BACK) reads the message
        assert restart.get("state_from", "").startswith("rank ") and restart["steps_lost"] == 0, \
            "\n".join([*notes, str(restart)])
    assert [t["node_ip"] for t in result["tasks"]] == [hosts.hosts[W1].address]
    assert result["tasks"][0]["optimizer_steps"] == 4 * (1437 // 16)  # the effective batch kept, every step
    assert hosts.leftovers() == {"actors": 0, "placement_groups": 0}
