"""A job that asks for GPUs the cluster does not have yet waits for the autoscaler to add GPU nodes and then
runs on them. Ray's fake multi-node provider plays the cloud: `RAY_FAKE_CLUSTER=1 ray start --head
--autoscaling-config=...` launches each new "node" as another raylet on this machine, with logical GPUs."""
import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, base_spec, write_job
from tests.ray_head import group_alive, start_head, stop_head

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

# Every top-level key of a cluster config must be present (worker_setup_commands included): the fake
# provider's monitor reads them without defaults and dies with a KeyError otherwise (logs/monitor.err).
FAKE_CLUSTER = {
    "cluster_name": "raytf-fake",
    "max_workers": 2,
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 5,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "auth": {},
    "docker": {},
    "head_node_type": "ray.head.default",  # the fake provider's fixed name for the head
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},  # no GPUs
        "gpu_node": {"resources": {"CPU": 1, "GPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
    },
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
}

NODES = textwrap.dedent('''
    import json, sys, time
    from ray.util.state import list_nodes
    deadline = time.time() + 30  # the head's raylet may register a moment after the dashboard is up
    while True:
        alive = {n.node_id: n.resources_total for n in list_nodes(address=sys.argv[1], raise_on_missing_output=False)
                 if n.state == "ALIVE"}
        if alive or time.time() > deadline:
            print(json.dumps(alive))
            break
        time.sleep(1)
''')


@pytest.fixture
def autoscaling_head():
    head, proc, log = start_head(["--num-cpus=1", "--num-gpus=0"], autoscaling_config=FAKE_CLUSTER,
                                 extra_env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    yield head
    stop_head(proc, head)
    assert not group_alive(proc.pid), "the head or its fake nodes outlived the test"


def alive_nodes(head) -> dict:
    proc = subprocess.run([sys.executable, "-c", NODES, head.address], env=head.env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_gpu_job_waits_for_the_autoscaler_and_runs_on_new_gpu_nodes(autoscaling_head, job_dir):
    head = autoscaling_head
    before = alive_nodes(head)
    assert len(before) == 1 and all(r.get("GPU", 0) == 0 for r in before.values())  # only the GPU-less head

    # strict_spread: one worker per node, so the autoscaler has to add two GPU nodes.
    spec = base_spec(train={"epochs": 1}, cluster={"workers": 2, "cpus_per_worker": 0.5, "gpus_per_worker": 1,
                                                   "placement": "strict_spread", "reserve_timeout_s": 90})
    path = write_job(job_dir, spec)
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "run", str(path), "--address", head.gcs_address],
                          env=head.env, capture_output=True, text=True, timeout=360, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads((job_dir / "runs" / "t" / "result.json").read_text())
    assert result["status"] == "succeeded"
    task_nodes = {t["node_id"] for t in result["tasks"]}
    assert len(task_nodes) == 2
    assert task_nodes.isdisjoint(before), "the job ran on a node that existed when it was submitted"
    after = alive_nodes(head)
    assert task_nodes <= set(after)
    assert all(after[n].get("GPU") == 2 for n in task_nodes)  # the autoscaler's gpu_node type
    assert all(len(t["gpu_ids"]) == 1 and t["cuda_visible_devices"] == t["gpu_ids"][0] for t in result["tasks"])
    assert result["phases"]["reserve_s"] > 1  # it waited for the nodes instead of failing at once
