"""What the job folder's package leaves out: every earlier run's and sweep's outputs, found by raytf's marker
or its result.json/sweep.json, and the default runs/; Ray's packaging lines never reach stderr in Ray's words.
No Ray is started: Ray's own packaging functions run on a folder in tmp_path."""
import json
import logging
from pathlib import Path

import pytest

from raytf.driver import packaging
from raytf.errors import SpecError
from raytf.job import Job, parse
from tests.conftest import base_spec

pytestmark = pytest.mark.timeout(60)


def _result(folder: Path, name: str = "old") -> None:
    """An earlier raytf run's output.dir as an earlier version of raytf left it: result.json, no marker."""
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"name": name, "strategy": "mirrored", "status": "failed",
                                                    "output_dir": str(folder), "tasks": [], "history": []}))
    (folder / "model.keras").write_bytes(b"m" * 100)


def test_every_earlier_runs_outputs_are_left_out_and_the_users_files_travel(tmp_path):
    job_dir = tmp_path / "job"
    (job_dir / "data" / "runs").mkdir(parents=True)
    (job_dir / "tmodel.py").write_text("x = 1\n")
    (job_dir / "data" / "train.parquet").write_bytes(b"p" * 10)
    (job_dir / "data" / "runs" / "notes.txt").write_text("a user's folder that happens to be named runs\n")
    _result(job_dir / "runs" / "first")  # the default output root
    (job_dir / "runs" / "loose.txt").write_text("x")
    _result(job_dir / "results" / "a b[1]")  # output.dir: results/a b[1] (a name with a space and brackets)
    (job_dir / "exp" / "sweep" / "tune").mkdir(parents=True)  # a sweep's output.dir, before markers
    (job_dir / "exp" / "sweep" / "sweep.json").write_text(json.dumps(
        {"name": "s", "metric": "val_loss", "mode": "min", "output_dir": "x", "rows": [], "best": None}))
    (job_dir / "exp" / "sweep" / "tune" / "experiment_state.json").write_text("{}")
    _result(job_dir / "exp" / "sweep" / "trials" / "p01")
    (job_dir / "exp" / "notes.md").write_text("kept\n")
    packaging.mark_output(job_dir / "elsewhere" / "new")  # a run of this raytf: its marker says it
    (job_dir / "elsewhere" / "new" / "model.keras").write_bytes(b"m")
    (job_dir / "mine").mkdir()
    (job_dir / "mine" / "result.json").write_text(json.dumps({"score": 1}))  # the user's own result.json
    (job_dir / "current").mkdir()
    (job_dir / "current" / "partial.bin").write_bytes(b"c")

    job = Job(spec=parse(base_spec(output={"dir": "current"})), job_dir=job_dir, source="job.yaml")
    excludes = packaging.excludes_for(job)
    packed = {path for path, _ in packaging.package_files(job_dir, excludes)}
    assert packed == {"tmodel.py", "data/train.parquet", "data/runs/notes.txt", "exp/notes.md",
                      "mine/result.json"}, excludes
    # a later job of the same folder: outermost folders only, nothing looked into twice
    assert packaging.earlier_outputs(job_dir, ("runs",)) == ["elsewhere/new", "exp/sweep", "results/a b[1]"]


def test_a_run_marks_its_output_dir_and_the_marker_is_enough(tmp_path):
    from raytf.driver.report import Result

    out = tmp_path / "job" / "any-name"
    Result(name="t", strategy="mirrored", status="failed", output_dir=str(out)).write()
    assert (out / packaging.OUTPUT_MARKER).is_file()
    (out / "result.json").unlink()
    assert packaging.is_output_dir(out) and not packaging.is_output_dir(tmp_path / "job")


def test_rays_packaging_lines_become_one_line_of_raytfs_own(tmp_path, capfd):
    """Ray's own zip function, as upload_code calls it: its "File ... is very large ... ray.init(...)"
    warning and its INFO lines are collected; raytf names the file in its words."""
    from ray._private.runtime_env.packaging import FILE_SIZE_WARNING, create_package

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "big.bin").write_bytes(b"b" * FILE_SIZE_WARNING)
    (folder / "small.py").write_text("x = 1\n")
    notes = []
    with packaging.ray_packaging_messages(verbose=False, note=notes.append) as logger:
        create_package(str(folder), tmp_path / "pkg.zip", include_gitignore=True, logger=logger)
    assert (tmp_path / "pkg.zip").is_file()
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert len(notes) == 1 and notes[0].startswith("raytf: uploading large files to every node: ")
    assert f"{folder / 'big.bin'} (10.00MiB)" in notes[0] and ".rayignore" in notes[0], notes
    assert "ray.init" not in notes[0]
    with packaging.ray_packaging_messages(verbose=True, note=notes.append) as logger:  # -v: Ray's own words
        assert logger is logging.getLogger("ray")
    assert len(notes) == 1


def test_a_submit_from_a_folder_with_credentials_packs_none_of_them_and_says_so(tmp_path, monkeypatch):
    """What `raytf submit` would upload, zipped by Ray's own function with raytf's excludes."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    from raytf import submit as jobs_api
    from tests.conftest import write_job

    job = tmp_path / "job"
    for rel, text in {"train.py": "def build(): pass\n", "data/rows.csv": "1,2\n", ".env": "KEY=1\n",
                      ".env.local": "KEY=2\n", ".ssh/id_rsa": "key", ".aws/credentials": "[default]\n",
                      ".ray/auth_token": "t" * 64, ".netrc": "machine x\n", "certs/server.pem": "pem",
                      "sub/.env": "KEY=3\n", ".gitignore": "", "notes.md": "hi\n"}.items():
        (job / rel).parent.mkdir(parents=True, exist_ok=True)
        (job / rel).write_text(text)
    write_job(job, base_spec(model="train:build", data=None, dataset_fn="train:build",
                             train={"steps_per_epoch": 2}))
    sub = jobs_api.prepare(job / "job.yaml")
    create_package(str(job), tmp_path / "pkg.zip", include_gitignore=True,
                   excludes=sub.runtime_env["excludes"])
    packed = sorted(n for n in zipfile.ZipFile(tmp_path / "pkg.zip").namelist() if not n.endswith("/"))
    assert packed == [".gitignore", "data/rows.csv", "job.yaml", "notes.md", "train.py"]
    for name in (".env", ".env.local", ".ssh/", ".aws/", ".ray/", ".netrc", "certs/server.pem", "sub/.env"):
        assert name in sub.left_out, sub.left_out
    monkeypatch.setenv("HOME", str(job))  # a job folder that is the home folder travels whole: refused
    with pytest.raises(SpecError, match="your home folder"):
        jobs_api.prepare(job / "job.yaml")


def test_a_task_process_gets_the_job_folder_and_the_drivers_modules_unpacked_once_per_node(tmp_path, monkeypatch):
    """pack_code zips the job folder (as Ray's runtime env would, outputs left out) and a model package found only
    in the driver's working directory; a task process (raytf.actor.task_code) sets TensorFlow's variables, unpacks
    both, and imports from them. Tasks unpacking at once on one node share one folder, never replaced."""
    import concurrent.futures
    import os
    import sys

    from raytf.actor import task_code

    job_dir, driver_cwd = tmp_path / "job", tmp_path / "driver"
    (driver_cwd / "shared_models").mkdir(parents=True)
    (driver_cwd / "shared_models" / "__init__.py").write_text("from shared_models.net import build\n")
    (driver_cwd / "shared_models" / "net.py").write_text("def build():\n    return 'built'\n")
    job_dir.mkdir()
    (job_dir / "run.sh").write_text("#!/bin/sh\n")
    (job_dir / "run.sh").chmod(0o755)
    _result(job_dir / "runs" / "t")
    monkeypatch.chdir(driver_cwd)
    (job_dir / "job.yaml").write_text("name: t\n")
    job = Job(spec=parse(base_spec(model="shared_models:build")), job_dir=job_dir, source="job.yaml")
    code = packaging.pack_code(job, store=lambda data: data)
    assert [m.name.startswith("_ray_pkg_") for m in code.modules] == [True]
    assert dict(code.env_vars)["TF_USE_LEGACY_KERAS"] == "0"

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(task_code, "_session_dir", lambda: str(tmp_path / "node"))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # four tasks of one node starting together
        roots = list(pool.map(lambda _: task_code.install(code), range(4)))
    assert len(set(roots)) == 1 and os.environ["TF_USE_LEGACY_KERAS"] == "0"
    root = Path(roots[0])
    assert sorted(p.name for p in root.iterdir()) == ["job.yaml", "run.sh"]  # runs/ (outputs) stayed behind
    assert os.access(root / "run.sh", os.X_OK)
    assert sorted(p.name for p in (tmp_path / "node" / "raytf_code").iterdir()) == sorted(
        [code.working_dir.name] + [m.name for m in code.modules])  # nothing half-unpacked left
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "shared_models", raising=False)
    import shared_models

    assert shared_models.build() == "built" and shared_models.__file__.startswith(str(tmp_path / "node"))
