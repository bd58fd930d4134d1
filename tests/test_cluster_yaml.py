"""cluster.yaml passes Ray's own cluster-config checks (the ones `ray up` runs before touching the cloud),
broken copies fail them, and its security defaults hold. No AWS credentials or network needed."""
import copy

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def config():
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def check(config):
    """What `ray up` does before it calls the cloud (commands._bootstrap_config): merge the provider's
    defaults, then validate against ray/autoscaler/ray-schema.json and the cross-field rules."""
    validate_config(prepare_config(copy.deepcopy(config)))


def test_cluster_yaml_passes_rays_schema(config):
    check(config)
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0  # a CPU head
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    cpu_types = [name for name, t in types.items() if t["resources"].get("GPU", 0) == 0 and name != config["head_node_type"]]
    assert len(gpu_types) == 2 and all(t["node_config"]["InstanceType"].startswith("g5.") for t in gpu_types)
    on_demand, spot = sorted(gpu_types, key=lambda t: "InstanceMarketOptions" in t["node_config"])
    assert spot["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot" and spot["resources"]["spot"] == 1
    assert "spot" not in on_demand["resources"]
    assert any("raytf spot-watch" in c for c in spot["worker_setup_commands"])  # the notice becomes a drain
    assert cpu_types, "a CPU-only worker type for parameter-server tasks"
    for t in (*gpu_types, *(types[n] for n in cpu_types)):
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"]


@pytest.mark.parametrize("breakage, complaint", [
    ("unknown top-level key", "'max_worker' was unexpected"),
    ("min_workers not an integer", "'one' is not of type 'integer'"),
    ("node type without resources", "'resources' is a required property"),
    ("head type that does not exist", "`head_node_type` must be one of `available_node_types`"),
])
def test_a_broken_copy_fails_the_schema(config, breakage, complaint):
    broken = copy.deepcopy(config)
    if breakage == "unknown top-level key":
        broken["max_worker"] = 3  # a typo of max_workers
    elif breakage == "min_workers not an integer":
        broken["available_node_types"]["gpu_worker"]["min_workers"] = "one"
    elif breakage == "node type without resources":
        del broken["available_node_types"]["cpu_worker"]["resources"]
    else:
        broken["head_node_type"] = "no_such_type"
    with pytest.raises((jsonschema.ValidationError, ValueError)) as info:
        check(broken)
    assert complaint in str(info.value)


def test_secure_defaults(config):
    text = (REPO / "cluster.yaml").read_text()
    start = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    # Token auth on, explicitly, on every node: without RAY_AUTH_MODE, `ray start` runs open when no token is found.
    for cmd in (config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]):
        assert "RAY_AUTH_MODE=token ray start" in cmd
    assert "disabled" not in start and "RAY_AUTH_MODE=disabled" not in text
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # one secret for nodes and laptop
    # Dashboard / Jobs API: on the head's loopback only, reached through `ray dashboard` port-forwarding.
    assert "--dashboard-host=127.0.0.1" in config["head_start_ray_commands"][-1]
    assert "0.0.0.0" not in start
    # No extra inbound rule: Ray's group allows all ports between cluster members and SSH from outside.
    assert "IpPermissions" not in config["provider"].get("security_group", {})
    for node_type in config["available_node_types"].values():
        assert "SecurityGroupIds" not in node_type["node_config"]


def test_setup_installs_raytf_with_the_pinned_stack(config):
    setup = " ".join(config["setup_commands"])
    assert '"tensorflow[and-cuda]==2.21.*"' in setup and '"ray[default,tune]==2.60.*"' in setup
    assert "-e ~/raytf" in setup and "--python 3.11" in setup
    assert config["file_mounts"]["~/raytf"] == "."
