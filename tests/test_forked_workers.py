"""Ray's workers forked from a zygote that has imported TensorFlow (raytf.forked_workers): which worker
starts take that path (pure), and on the session's cluster that they do, with TensorFlow already there."""
import json
import os
import sys

import pytest

from raytf.forked_workers import launcher

WORKER = "/site-packages/ray/_private/workers/default_worker.py"


@pytest.mark.parametrize("args", [
    ["--serialized-runtime-env-context={}", "--language=PYTHON", WORKER, "--startup-token=3"],
    ["--serialized-runtime-env-context", "{}", "--language", "PYTHON", WORKER, "--startup-token=3"],
])
def test_the_launcher_reads_rays_options_in_either_form_and_keeps_the_workers_own(args):
    assert launcher.split_args(args) == ("{}", "PYTHON", [WORKER, "--startup-token=3"])


@pytest.mark.parametrize("context, language, forked", [
    ("{}", "PYTHON", True),
    (json.dumps({"py_executable": sys.executable, "env_vars": {}}), "PYTHON", True),  # Ray's default, unchanged
    (json.dumps({"env_vars": {"PL_DISABLE_FORK": "1", "AWS_ACCESS_KEY_ID": "k"}}), "PYTHON", True),  # Tune's trials
    (json.dumps({"env_vars": {"TF_USE_LEGACY_KERAS": "1"}}), "PYTHON", False),  # read at import: Ray's own path
    (json.dumps({"env_vars": {"RAY_JOB_ID": "02000000"}}), "PYTHON", False),  # Ray's config, read at its import
    (json.dumps({"env_vars": {"OMP_NUM_THREADS": "1"}}), "PYTHON", False),  # the BLAS pool the zygote loaded
    (json.dumps({"py_executable": "/opt/conda/bin/python"}), "PYTHON", False),
    (json.dumps({"command_prefix": ["cd", "/x", "&&"]}), "PYTHON", False),
    ("{}", "JAVA", False),
    ("not json", "PYTHON", False),
])
def test_only_a_python_worker_whose_runtime_env_leaves_its_start_and_imports_alone_is_forked(context, language,
                                                                                             forked, monkeypatch):
    monkeypatch.delenv("RAYTF_FORKED_WORKERS", raising=False)
    assert (launcher.forked_env(context, language, [WORKER]) is not None) is forked


def test_a_forked_workers_env_vars_are_applied_as_rays_setup_worker_would(monkeypatch):
    monkeypatch.setenv("BASE", "/data")
    monkeypatch.delenv("UNSET_HERE", raising=False)
    context = json.dumps({"env_vars": {"A": "${BASE}/a", "B": "$A/b", "C": "${UNSET_HERE}c", "BASE": "/other"}})
    env = launcher.forked_env(context, "PYTHON", [WORKER])
    assert (env["A"], env["B"], env["C"], env["BASE"]) == ("/data/a", "/data/a/b", "c", "/other")
    assert env["PATH"] == os.environ["PATH"]  # the launcher's own environment underneath


def test_raytf_forked_workers_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("RAYTF_FORKED_WORKERS", "0")
    assert launcher.forked_env("{}", "PYTHON", [WORKER]) is None


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_worker_on_the_cluster_is_forked_with_tensorflow_imported_its_env_vars_set_unless_read_at_import(cluster):
    import psutil
    import ray

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, bool, str | None]:
        import os

        parent = " ".join(psutil.Process(os.getppid()).cmdline())
        return parent, "tensorflow" in sys.modules, os.environ.get("RAYTF_TEST_VAR")

    forked_parent, tf_there, _ = ray.get(where.remote(), timeout=90)
    assert "forked_workers/zygote.py" in forked_parent and tf_there
    # as every Tune trial and the actors it starts: env_vars of no import's concern, set in the forked worker
    forked_parent, tf_there, var = ray.get(where.options(runtime_env={"env_vars": {"RAYTF_TEST_VAR": "1"}}).remote(),
                                           timeout=90)
    assert "forked_workers/zygote.py" in forked_parent and tf_there and var == "1"
    started_parent, tf_there, _ = ray.get(where.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(),
                                          timeout=90)
    assert "raylet" in started_parent and not tf_there
