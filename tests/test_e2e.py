"""The README's first command, verbatim, as a new user runs it: from inside jobs/ of a fresh copy of the
repository, on an embedded local Ray (even with another cluster up). From the repository root it is
.ci/run's first step (a clean clone, the same checks)."""
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, task_files_in_temp_dir
from tests.test_user_paths import assert_quiet, files_under, run_cli

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def readme_job_command() -> list[str]:
    """`raytf run ...` of the README's first command (`pip install -e . && raytf run jobs/digits.yaml`);
    the install is what this test process already is."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    first = block.splitlines()[0].split("#")[0]
    command = first.split("&&")[-1].strip()
    assert command.startswith("raytf run "), first
    return shlex.split(command)


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory):
    """What a clone holds: the tracked files and the untracked ones git does not ignore (no runs/)."""
    copy = tmp_path_factory.mktemp("clone") / "raytf"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, copy / rel)
    return copy


def check_digits_run(proc, copy: Path, jobs_before: set[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = copy / "runs" / "digits"  # "The first writes runs/digits/ (next to jobs/)"
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "succeeded" and len(result["history"]) == 15
    assert result["history"][-1]["val_accuracy"] >= 0.9
    assert (out / "model.keras").is_file() and any((out / "tensorboard").rglob("events.out.tfevents*"))
    assert len({t["weights_digest"] for t in result["tasks"]}) == 1
    assert files_under(copy / "jobs") == jobs_before  # nothing else appeared in jobs/
    assert "digits succeeded" in proc.stdout and "epoch 15 done" in proc.stderr
    assert_quiet(proc)


@pytest.mark.parametrize("where", ["inside jobs/"])
def test_readme_job_trains_digits_from_a_fresh_copy(cluster, fresh_copy, where):
    """With another Ray cluster already running on the machine (the test cluster), the job must still
    start its own embedded Ray rather than join that one."""
    test_cluster, gpu_nodes = cluster
    shutil.rmtree(fresh_copy / "runs", ignore_errors=True)
    jobs_before = files_under(fresh_copy / "jobs")
    temp_before = task_files_in_temp_dir()
    argv = readme_job_command()
    if where == "inside jobs/":
        argv = [*argv[:2], argv[2].removeprefix("jobs/")]
    proc = run_cli(argv[1:], cwd=fresh_copy if where == "the repository root" else fresh_copy / "jobs", timeout=280,
                   extra_env={"PYTHONPATH": str(fresh_copy)})
    check_digits_run(proc, fresh_copy, jobs_before)
    assert task_files_in_temp_dir() - temp_before == set()  # the embedded Ray's tasks took their files along
    result = json.loads((fresh_copy / "runs" / "digits" / "result.json").read_text())
    known = {gpu.node_id for gpu in gpu_nodes} | {test_cluster.head_node.node_id}
    assert not {t["node_id"] for t in result["tasks"]} & known
