"""Ray's workers forked from a zygote that has imported TensorFlow (raytf.forked_workers): which worker
starts take that path (pure), and on the session's cluster that they do, with TensorFlow already there."""
import json
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
    (json.dumps({"env_vars": {"TF_USE_LEGACY_KERAS": "1"}}), "PYTHON", False),  # read at import: Ray's own path
    (json.dumps({"py_executable": "/opt/conda/bin/python"}), "PYTHON", False),
    (json.dumps({"command_prefix": ["cd", "/x", "&&"]}), "PYTHON", False),
    ("{}", "JAVA", False),
    ("not json", "PYTHON", False),
])
def test_only_a_python_worker_whose_runtime_env_leaves_its_start_alone_is_forked(context, language, forked,
                                                                                  monkeypatch):
    monkeypatch.delenv("RAYTF_FORKED_WORKERS", raising=False)
    assert launcher.forkable(context, language, [WORKER]) is forked


def test_raytf_forked_workers_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("RAYTF_FORKED_WORKERS", "0")
    assert launcher.forkable("{}", "PYTHON", [WORKER]) is False


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_worker_on_the_cluster_is_forked_with_tensorflow_imported_and_one_with_env_vars_is_started_by_ray(cluster):
    import psutil
    import ray

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, bool]:
        import os

        parent = " ".join(psutil.Process(os.getppid()).cmdline())
        return parent, "tensorflow" in sys.modules

    forked_parent, tf_there = ray.get(where.remote(), timeout=90)
    assert "forked_workers/zygote.py" in forked_parent and tf_there
    started_parent, tf_there = ray.get(where.options(runtime_env={"env_vars": {"X": "1"}}).remote(), timeout=90)
    assert "raylet" in started_parent and not tf_there
