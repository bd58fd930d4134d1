"""The README's first command, as a new user runs it: the default job on an embedded local Ray."""
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)


def test_readme_job_trains_digits_to_90_percent_on_embedded_ray(tmp_path, cluster):
    """With another Ray cluster already running on the machine (the test cluster), the job must still
    start its own embedded Ray rather than join that one."""
    test_cluster, gpu_nodes = cluster
    out = tmp_path / "digits"
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "run", "jobs/digits.yaml", "--set", f"output.dir={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "succeeded" and len(result["history"]) == 15
    assert result["history"][-1]["val_accuracy"] >= 0.9
    assert (out / "model.keras").is_file()
    known = {gpu.node_id for gpu in gpu_nodes} | {test_cluster.head_node.node_id}
    assert not {t["node_id"] for t in result["tasks"]} & known
    assert "digits succeeded" in proc.stdout
    assert "epoch 15 done" in proc.stderr  # the progress display reports every epoch
