"""Shared fixtures: a self-contained job folder (model module + real digits Parquet) in a temp dir."""
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "jobs" / "data"

# Two pytest-xdist workers (pyproject's addopts), each taking the next test as it frees up: each gets a temp
# folder of its own before anything reads it, so the Ray clusters it starts (Ray keeps its sessions and its "current
# cluster" file there), the tasks' scratch folders and the leak checks that read them (task_files_in_temp_dir)
# never meet the other worker's. Each worker makes the session's fixtures (its own 3-node cluster) once.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    _worker_tmp = os.path.join("/tmp", f"raytf-tests-{_WORKER}")
    os.makedirs(_worker_tmp, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = _worker_tmp

MODEL_MODULE = textwrap.dedent('''
    import keras

    def build_model():
        return keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dense(10)])

    not_a_function = 3
''')


# The tiers (docs/concepts/tests.md), as markers: `python -m pytest -m pure` (no Ray cluster and no TensorFlow
# in the test process; a console script or subprocess a test runs may import it), `-m tf` (TensorFlow in the test
# process, no cluster), `-m cluster` (marked where a test starts Ray nodes), `-m user_path` (the installed console
# script, end to end). A module is tf when its tests import TensorFlow (measured: each module's non-cluster
# tests run alone, `"tensorflow" in sys.modules` after each test).
USER_PATH_MODULES = {"test_user_paths.py", "test_real_code.py", "test_e2e.py"}
TF_MODULES = {"test_bad_input.py", "test_checkpoint_safety.py", "test_data.py", "test_images.py", "test_labels.py",
              "test_large_batches.py", "test_loop_stop.py", "test_ps_train_fn.py", "test_run_lifecycle.py",
              "test_serving.py", "test_spec.py", "test_string_list_columns.py", "test_task_code.py", "test_tune.py",
              "test_image_jobs.py", "test_parameter_server.py", "test_preemption.py", "test_initial_values.py"}


def tier_of(module: str, cluster: bool) -> list[str]:
    """A test's tier markers, from its module and whether it is marked cluster."""
    if module in USER_PATH_MODULES:
        return ["user_path"]
    if cluster:
        return []
    return ["tf"] if module in TF_MODULES else ["pure"]


# Modules whose module-scoped fixtures start something (hosts in network namespaces, a Ray head, nodes, a training
# run): their tests stay on one xdist worker (`--dist loadgroup`), so it is started once, and the namespaces'
# fixed names are never made twice at once.
SHARED_FIXTURE_MODULES = {"test_multi_host.py", "test_submit.py", "test_preemption.py", "test_own_loop.py",
                          "test_ps_train_fn.py", "test_labels.py", "test_fault_tolerance.py"}


def run_order(tiers: list[str]) -> int:
    """Where a test runs: the long ones (a cluster's, the console script's) first and the quick ones last, so the two
    xdist workers, each taking the next test as it frees up, end together instead of one waiting out the other's
    last long test."""
    return 2 if "pure" in tiers else 1 if "tf" in tiers else 0


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group markers added here
def pytest_collection_modifyitems(config, items):
    order = {}
    for item in items:
        tiers = tier_of(item.path.name, item.get_closest_marker("cluster") is not None)
        for name in tiers:
            item.add_marker(name)
        order[item.nodeid] = run_order(tiers)
        if item.path.name in SHARED_FIXTURE_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    items.sort(key=lambda item: order[item.nodeid])  # stable: each module's tests keep their order


def _cpu_jiffies() -> tuple[int, int]:
    """The machine's (busy, idle) jiffies so far, from /proc/stat (idle counts iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, idle


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With RAYTF_TEST_CPU_LOG=<file>: one line per test (setup, call and teardown) of its wall seconds and the
    machine's busy and idle core-seconds meanwhile, the test, its xdist worker and its end (epoch seconds): where
    the suite's time goes and whether the two workers end together (docs/concepts/tests.md)."""
    log = os.environ.get("RAYTF_TEST_CPU_LOG")
    if not log:
        yield
        return
    tick = os.sysconf("SC_CLK_TCK")
    start, (busy0, idle0) = time.monotonic(), _cpu_jiffies()
    yield
    busy1, idle1 = _cpu_jiffies()
    with open(log, "a") as f:
        f.write(f"{time.monotonic() - start:.1f}\t{(busy1 - busy0) / tick:.1f}\t{(idle1 - idle0) / tick:.1f}\t"
                f"{item.nodeid}\t{_WORKER or '-'}\t{time.time():.0f}\n")


def base_spec(**sections):
    spec = {
        "name": "t",
        "model": "tmodel:build_model",
        "data": {"train": "data/digits-train.parquet", "validation": "data/digits-test.parquet",
                 "features": ["pixels"], "label": "label"},
        "loss": {"name": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"name": "adam", "learning_rate": 0.01},
        "metrics": ["accuracy"],
        "train": {"epochs": 2, "global_batch_size": 64, "seed": 0},
        "cluster": {"workers": 2, "cpus_per_worker": 0.5, "reserve_timeout_s": 30},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def fill_job_folder(folder: Path, model_module: str = MODEL_MODULE) -> Path:
    """A job folder's model module (tmodel.py) and the digits Parquet (data/)."""
    (folder / "tmodel.py").write_text(model_module)
    shutil.copytree(DIGITS, folder / "data", ignore=shutil.ignore_patterns("*.py"))
    return folder


@pytest.fixture
def job_dir(tmp_path_factory):
    return fill_job_folder(tmp_path_factory.mktemp("job"))


def write_job(folder: Path, spec: dict, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="session")
def s3():
    """A real S3 API on localhost (tests/s3_server.py), its endpoint and credentials in os.environ."""
    from tests import s3_server

    return s3_server.start()


@pytest.fixture(scope="session")
def mlflow():
    """A real MLflow tracking server on localhost (tests/mlflow_server.py), started by the first test that asks
    (two of test_cluster's): ~10 CPU-s to start, for an xdist worker that may never need it."""
    from tests import mlflow_server

    return mlflow_server.server()


def _quiet_cluster():
    from ray.cluster_utils import Cluster

    from raytf import forked_workers

    class QuietCluster(Cluster):
        """A local cluster whose nodes run no log monitor (the session's cluster, below) and whose workers are
        forked from a zygote, as an embedded Ray's (raytf.forked_workers)."""

        def add_node(self, wait=True, **node_args):
            node_args.setdefault("include_log_monitor", False)
            if forked_workers.enabled():  # as raytf's embedded Ray: workers forked from a warm zygote
                node_args.setdefault("setup_worker_path", forked_workers.LAUNCHER)
            return super().add_node(wait, **node_args)

    return QuietCluster


@pytest.fixture(scope="session")
def cluster(s3):
    """A local 3-node Ray cluster shared by the test session: a 1-CPU head and two 1-CPU nodes with
    2 logical GPUs each (Ray sets CUDA_VISIBLE_DEVICES per actor; TF runs on CPU). Its nodes reach the
    session's S3 server (they inherit its variables)."""
    import ray

    QuietCluster = _quiet_cluster()
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # a recorded value in the endpoint within 1 s, not 10
    from tests.ray_head import free_port
    from raytf.driver.session import EMBEDDED_RAY_CONFIG

    # The head's dashboard and its agent on free ports: Ray's defaults (8265, 52365) are fixed, not retried, and
    # the other xdist worker's cluster may hold them (a head without its dashboard answers no state API call).
    # No log monitor on its nodes, and this process takes no worker output: no test reads the workers' lines
    # through the session's cluster (raytf's console script shows them only with -v, tested on an embedded Ray),
    # and a log monitor, listing every log file of the session ten times a second, cost ~37 CPU-s over a run.
    # Its nodes prestart no idle workers and its head runs no autoscaler monitor, as raytf's embedded Ray.
    # Once in a while a head's dashboard fails to start ("Failed to start the dashboard", both xdist workers'
    # clusters starting in the same second), and every state-API call of the session then fails: a head whose
    # dashboard did not register is started again, once.
    for attempt in (1, 2):
        c = QuietCluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "dashboard_port": free_port(), "dashboard_agent_listen_port": free_port(),
            "_system_config": EMBEDDED_RAY_CONFIG, "no_monitor": True})
        gpu_nodes = [c.add_node(num_cpus=1, num_gpus=2) for _ in range(2)]
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        if attempt == 2 or _dashboard_registered(timeout_s=30):
            break
        ray.shutdown()
        c.shutdown()
    yield c, gpu_nodes
    ray.shutdown()
    c.shutdown()


def _dashboard_registered(timeout_s: float) -> bool:
    """Whether this process's cluster's dashboard put its address in the GCS (what the state API reads)."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    end = time.time() + timeout_s
    while time.time() < end:
        if _internal_kv_get(ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD):
            return True
        time.sleep(0.5)
    return False


def assert_nothing_left(deadline_s=15):
    """No live raytf actor and no placement group that is not removed."""
    import ray
    from ray.util.state import list_actors

    end = time.time() + deadline_s
    while True:
        # this process's cluster, by its address: without one Ray asks the newest cluster on the machine
        actors = [a for a in list_actors(address=ray.get_runtime_context().gcs_address,
                                         filters=[("state", "=", "ALIVE")]) if a.class_name == "TaskActor"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not actors and not groups:
            return
        if time.time() > end:
            pytest.fail(f"leaked: {len(actors)} actors, placement groups {[g['state'] for g in groups]}")
        time.sleep(0.5)


def task_files_in_temp_dir() -> set[str]:
    """What tasks could leave in this machine's temp dir: raytf's scratch folders, AutoGraph's sources."""
    from raytf.actor import scratch

    return {e.name for e in os.scandir(tempfile.gettempdir())
            if e.name.startswith((scratch.PREFIX, "__autograph_generated_file"))}
