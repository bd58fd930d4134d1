"""A run lives in storage: output.dir as a URI on a real S3 API (tests/s3_server.py), `resume: auto` across
clusters, attempts in result.json, `raytf results`, bad storage found before anything starts. (The KubeRay
RayJob manifest of `raytf k8s` is test_k8s's.)

(The parameter-server job and the sweep into a bucket are test_parameter_server's; the submitted job's is
test_submit's.)"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from raytf.driver import attempts
from tests.conftest import base_spec, write_job

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.timeout(120)


def raytf_cli(*args, cwd, env=None, timeout=100) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "raytf"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def listing(folder: Path) -> list[str]:
    """What the user's job folder holds (bytecode aside: Python writes it wherever a module is imported)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts)


# ---------------------------------------------------------------- bad storage: before anything starts


@pytest.mark.parametrize("where, says", [
    ("foo://bucket/runs/m", "pyarrow cannot open it (Unrecognized filesystem type in URI: foo://bucket/runs/m)"),
    ("s3://no-such-bucket-raytf/runs/m", "Bucket 'no-such-bucket-raytf' not found"),
    ("s3://{bucket}/runs/m@unreachable", "does not answer"),
])
def test_bad_storage_is_one_line_and_exit_2_before_any_code_runs(s3, job_dir, where, says):
    env = None
    if where.endswith("@unreachable"):  # an endpoint nothing listens on
        where, env = where.removesuffix("@unreachable").format(bucket=s3.bucket()), {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    (job_dir / "tmodel.py").write_text("raise SystemExit('the job code was imported')\n")
    write_job(job_dir, base_spec())
    before = listing(job_dir)
    proc = raytf_cli("run", "job.yaml", "--set", f"output.dir={where}", cwd=job_dir, env=env)

    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"raytf: error: output.dir {where}"), lines
    assert says in lines[0] and "Traceback" not in proc.stderr
    assert listing(job_dir) == before  # no folder named "s3:" or "foo:" made in the job folder


# ---------------------------------------------------------------- results, attempts, the command line


def test_raytf_results_reads_a_run_from_the_bucket_and_says_when_there_is_none(s3, tmp_path):
    out = f"s3://{s3.bucket()}/runs/m"
    fs = s3.fs()
    saved = {"name": "m", "strategy": "mirrored", "status": "failed", "output_dir": out, "error": "boom",
             "history": [{"epoch": 1, "loss": 0.5}], "tasks": [], "exports": {},
             "attempts": [{"attempt": 1, "cluster": {"session": "session_a"}, "host": "h", "started": "t0",
                           "ended": "t1", "ended_because": "failed: boom", "resumed_from_step": None}]}
    with fs.open_output_stream(out.removeprefix("s3://") + "/result.json") as f:
        f.write(json.dumps(saved).encode())

    shown = raytf_cli("results", out, cwd=tmp_path)
    assert shown.returncode == 1, shown.stderr  # a failed run
    assert shown.stdout.splitlines()[0] == f"m: failed (boom) -- {out}/result.json"
    assert "attempt 1: t0 .. t1 on h (session_a): failed: boom" in shown.stdout
    as_json = raytf_cli("results", out, "--json", cwd=tmp_path)
    assert json.loads(as_json.stdout) == saved
    missing = raytf_cli("results", out + "-nothing", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith(f"raytf: error: no result.json in {out}-nothing")


def test_a_finished_run_in_a_local_output_dir_is_answered_from_there_by_its_job_file(job_dir):
    """resume: auto and `raytf results JOB_FILE` with output.dir a plain folder: the same answers as a bucket's,
    without importing the job's code or starting Ray."""
    (job_dir / "tmodel.py").write_text("raise SystemExit('the job code was imported')\n")
    write_job(job_dir, base_spec(name="done", resume="auto"))
    out = job_dir / "runs" / "done"
    out.mkdir(parents=True)
    saved = {"name": "done", "strategy": "mirrored", "status": "succeeded", "output_dir": str(out),
             "history": [{"epoch": 1, "loss": 0.25}], "tasks": [], "exports": {"keras": str(out / "model.keras")}}
    (out / "result.json").write_text(json.dumps(saved))

    again = raytf_cli("run", "job.yaml", cwd=job_dir)
    assert again.returncode == 0, again.stderr
    assert again.stderr.startswith(f"raytf: resume: auto: done already succeeded in {out}/result.json; nothing to train")
    assert f"raytf: result {out}/result.json; keras {out}/model.keras" in again.stdout
    assert json.loads((out / "result.json").read_text()) == saved  # untouched
    shown = raytf_cli("results", "job.yaml", cwd=job_dir)
    assert shown.returncode == 0 and shown.stdout.splitlines()[0] == f"done: succeeded -- {out}/result.json"
    by_name = raytf_cli("results", "done", cwd=job_dir)  # runs/<name> here
    assert by_name.stdout == shown.stdout
    fresh = raytf_cli("run", "job.yaml", "--set", "name=other", cwd=job_dir)  # another run: its code is needed
    assert fresh.returncode != 0 and "the job code was imported" in fresh.stderr


def test_a_run_that_fails_before_its_controller_writes_ends_failed_not_running(tmp_path):
    """(e.g. the job folder's upload failing): result.json says failed, and the attempt why."""
    from raytf.driver.run import close_unfinished
    from raytf.driver.report import Result
    from raytf.job import Job, parse

    job = Job(spec=parse(base_spec(output={"dir": str(tmp_path / "out")})), job_dir=tmp_path)
    running = Result(name="t", strategy="mirrored", status="running", output_dir=job.output_where,
                     attempts=[attempts.begin(1, {"session": "s"}, None)])
    job.output_dir.mkdir()
    (job.output_dir / "result.json").write_text(running.json_text())
    close_unfinished(job, running, RuntimeError("the job folder could not be uploaded"))
    saved = json.loads((job.output_dir / "result.json").read_text())
    assert saved["status"] == "failed" and saved["error"] == "the job folder could not be uploaded"
    assert saved["attempts"][0]["ended_because"] == "failed: the job folder could not be uploaded"

    close_unfinished(job, Result(name="t", strategy="mirrored", status="running", output_dir=job.output_where,
                                  attempts=[{}]), KeyboardInterrupt())  # written already: left as it is
    assert json.loads((job.output_dir / "result.json").read_text()) == saved


def test_a_new_run_moves_an_earlier_runs_results_aside_in_the_bucket_and_keeps_its_checkpoints(s3):
    from raytf.driver.output import move_earlier
    from raytf.storage import Folder

    out = Folder(f"s3://{s3.bucket()}/runs/m")
    out.write_json("result.json", {"name": "m", "attempts": [{"started": "2026-12-05T02:05:42+0000"}]})
    out.write_bytes("saved_model/variables/variables.index", b"index")
    out.write_bytes("checkpoints/ckpt-000000000044/raytf.json", b"{}")

    moved = move_earlier(out)
    assert moved == f"{out.where}/earlier-runs/20261205-020542"
    assert sorted(s3.files(out.where)) == ["checkpoints/ckpt-000000000044/raytf.json",
                                           "earlier-runs/20261205-020542/result.json",
                                           "earlier-runs/20261205-020542/saved_model/variables/variables.index"]
    assert move_earlier(out) is None  # nothing left to move


def test_an_attempt_that_never_wrote_its_end_is_marked_lost_and_only_a_finished_run_of_the_same_name_counts():
    earlier = {"name": "m", "status": "running",
               "attempts": [{"attempt": 1, "started": "t0", "ended": None, "ended_because": None}]}
    carried = attempts.carried(earlier, "m")
    assert carried[0]["ended_because"] == attempts.LOST and earlier["attempts"][0]["ended_because"] is None
    assert attempts.carried(earlier, "another") == []
    assert not attempts.succeeded(earlier, "m")
    assert attempts.succeeded({**earlier, "status": "succeeded"}, "m")
    assert not attempts.succeeded({**earlier, "status": "succeeded"}, "another")
    this = attempts.begin(2, {"session": "s"}, 44)
    attempts.end(this, "failed", "x" * 1000)
    assert this["ended"] and this["ended_because"] == "failed: " + "x" * 300


@pytest.mark.parametrize("args, resume", [
    (["--resume", "auto", "job.yaml"], "auto"), (["job.yaml", "--resume", "auto"], "auto"),
    (["job.yaml", "--resume=auto"], "auto"), (["--resume", "job.yaml"], True), (["job.yaml"], None),
])
def test_resume_auto_is_a_value_and_a_bare_resume_stays_a_flag_wherever_it_stands(args, resume):
    from raytf.cli import run

    params = run.make_context("run", list(args)).params
    assert params["job_file"] == "job.yaml"
    assert ("auto" if params["resume_auto"] else (True if params["resume"] else None)) == resume


def test_a_bad_resume_value_names_the_three_it_takes():
    from raytf.errors import SpecError
    from raytf.job import parse

    with pytest.raises(SpecError, match=r"^job spec: resume: 'always' is not one of false, true, auto; e\.g\. resume: auto$"):
        parse(base_spec(resume="always"))
    assert parse(base_spec(resume="auto")).resume == "auto" and parse(base_spec()).resume is False


def test_submit_says_where_the_results_go(job_dir):
    from raytf import submit

    path = write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    sub = submit.prepare(path)
    assert sub.metadata[submit.OUTPUT_KEY] == "s3://team/runs/t"  # `raytf status` reads the run from there
    assert sub.results == "raytf: results go to s3://team/runs/t (`raytf results s3://team/runs/t` reads them)"
    local = submit.prepare(write_job(job_dir, base_spec()))
    assert submit.OUTPUT_KEY not in local.metadata
    assert "runs/t/ in the head's temporary copy of the job folder, which Ray removes" in local.results
    assert "--set output.dir=s3://bucket/runs/t" in local.results


# ---------------------------------------------------------------- a run killed, then started on a new cluster

PACED_MODEL = textwrap.dedent('''
    """tmodel's model with a pause in each step, so that a run can be killed between two epochs."""
    import time

    import keras
    import tensorflow as tf

    from tmodel import build_model as _build


    class Pace(keras.layers.Layer):
        def call(self, x, training=None):
            if training:  # serving (the SavedModel's signature) has no pause
                tf.py_function(lambda: time.sleep(0.04), [], [])
            return x


    def build_model():
        inner = _build()
        return keras.Sequential([keras.Input(shape=(64,)), Pace(), *inner.layers])
''')


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_run_killed_after_two_checkpoints_resumes_from_the_bucket_on_a_new_cluster_and_then_trains_nothing(
        s3, cluster, job_dir, tmp_path):
    """`raytf run --resume auto` with output.dir in a bucket, killed (SIGKILL to it and its embedded Ray) after
    its second checkpoint (a second driver on the same run is refused meanwhile); the same command again, on
    another cluster (the session's: an embedded Ray's start less), continues from the bucket and every epoch
    is trained once; a third start trains nothing. Everything is in the bucket, nothing in the job folder.

    Before the kill the store holds the checkpoints' writes (a proxy in front of it): the chief's next checkpoint
    waits for the held upload, and the watchdog (failure.hang_mode observe) names it, in storage I/O, while its
    peer waits in the step's collective, and the job goes on; the held checkpoint is never listed (never torn)."""
    from tests.s3_server import FaultProxy

    (job_dir / "paced.py").write_text(PACED_MODEL)
    out = f"s3://{s3.bucket()}/runs/m"
    write_job(job_dir, base_spec(name="m", model="paced:build_model", train={"epochs": 5},
                                 output={"dir": out}, failure={"hang_timeout_s": 8, "hang_mode": "observe"}))
    before = listing(job_dir)
    command = [str(BIN / "raytf"), "run", "job.yaml", "--resume", "auto"]

    proxy = FaultProxy(s3.endpoint)
    first = subprocess.Popen(command, cwd=job_dir, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env={**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint})
    said_first: list[str] = []
    threading.Thread(target=lambda: said_first.extend(first.stdout), daemon=True).start()
    try:
        deadline = time.time() + 150
        while len([f for f in s3.files(f"{out}/checkpoints") if f.endswith("/raytf.json")]) < 2:
            assert first.poll() is None and time.time() < deadline, "".join(said_first[-30:])
            time.sleep(0.1)
        # At once (an epoch takes ~1 s, the refused driver below seconds): the next checkpoint's upload never answers
        proxy.fault("hold", match=r"^PUT \S*/checkpoints/")
        # A second driver on the same run, as from another machine (its own temp folder): refused in one line
        # before it reads the job's code, and it writes nothing (result.json below is still the first's).
        other_tmp = tmp_path / "other-machine-tmp"
        other_tmp.mkdir()
        refused = subprocess.run(command, cwd=job_dir, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "TMPDIR": str(other_tmp)})
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"raytf: error: output.dir {out} is in use by another run (pid {first.pid} on {socket.gethostname()}, "
            + refused.stderr.split(f"pid {first.pid} on {socket.gethostname()}, ", 1)[1].strip()]
        assert "lease renewed until" in refused.stderr and list(other_tmp.iterdir()) == []

        while not any("every rank's stacks are in" in line for line in said_first):
            assert first.poll() is None and time.time() < deadline, "".join(said_first[-30:])
            time.sleep(0.1)
        time.sleep(1.0)  # the rank lines follow the first
        assert first.poll() is None  # observe: named, and the job goes on
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver and its embedded Ray: the cluster is gone
        first.wait(30)
        proxy.close()
    report = "".join(said_first)
    assert "(failure.hang_mode observe: the job goes on)" in report, report[-3000:]
    # Both ranks stall in the same step; the watchdog's "no progress" goes to whichever last changed state first
    # (the chief's "checkpointing" or its peer's entering the collective, seen at the driver's polls), a sub-second
    # race under load. What each was doing is named either way: the chief in storage I/O, its peer in the collective.
    waiting = re.search(r"raytf:   rank 0 \(chief, step (\d+) \w+(, no progress)?\): storage I/O at uploads\.py:\d+ "
                        r"in _wait", report)
    assert waiting, report[-3000:]
    assert re.search(r"raytf:   rank 1 \(worker, step \d+ \w+(, no progress)?\): a TensorFlow step or collective at ",
                     report), report[-3000:]
    killed = json.loads(s3.read(f"{out}/result.json"))
    assert killed["status"] == "running" and killed["attempts"][0]["ended"] is None

    second = subprocess.run(command + ["--address", cluster[0].address], cwd=job_dir, capture_output=True, text=True,
                            timeout=200, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    said = re.search(r"raytf: resume: auto: continuing from step (\d+) \(epoch (\d+)\) in " + re.escape(out),
                     second.stderr)
    assert said, second.stderr[-3000:]
    step, epoch = int(said.group(1)), int(said.group(2))
    assert step in (44, 66, 88) and epoch == step // 22 + 1  # at or after the second checkpoint, before the end
    # the chief waited at this epoch's checkpoint for the last one's upload, held: that one was never listed
    assert step == int(waiting.group(1)) - 2 * 22
    trained = [int(e) for e in re.findall(r"^epoch (\d+) done", second.stderr, re.M)]
    assert trained == list(range(epoch, 6)), second.stderr[-3000:]  # this attempt trained only what was left
    result = json.loads(s3.read(f"{out}/result.json"))
    assert result["status"] == "succeeded"
    assert [h["epoch"] for h in result["history"]] == [1, 2, 3, 4, 5]  # every epoch once
    assert [h["examples"] for h in result["history"]] == [1408] * 5
    first_try, second_try = result["attempts"]
    assert first_try["ended_because"] == attempts.LOST and second_try["ended_because"] == "succeeded"
    assert second_try["resumed_from_step"] == step
    assert first_try["cluster"]["session"] != second_try["cluster"]["session"]  # another Ray cluster
    assert len({t["weights_digest"] for t in result["tasks"]}) == 1
    stored = s3.files(out)
    assert {"result.json", "model.keras"} <= set(stored), sorted(stored)  # (the SavedModel: the PS job's test)
    # the killed run's hang report (its staging folder) shipped by the next run: every thread's stack per rank
    assert "uploads.py" in s3.read(f"{out}/hangs/attempt-1/rank-0.txt").decode()
    assert any(name.startswith("tensorboard/") for name in stored)
    assert result["model_path"] == f"{out}/model.keras" and result["output_dir"] == out
    assert f"raytf: result {out}/result.json" in second.stdout

    (job_dir / "paced.py").write_text("raise SystemExit('the job code was imported')\n")
    third = subprocess.run(command, cwd=job_dir, capture_output=True, text=True, timeout=100)
    assert third.returncode == 0, third.stderr
    assert f"raytf: resume: auto: m already succeeded in {out}/result.json; nothing to train" in third.stderr
    assert "workers' logs" not in third.stderr  # no Ray started, and the job's code not even imported
    assert json.loads(s3.read(f"{out}/result.json")) == result
    shown = raytf_cli("results", out, cwd=job_dir)
    assert shown.returncode == 0 and "attempt 2:" in shown.stdout and f"from step {step}: succeeded" in shown.stdout
    assert listing(job_dir) == before  # nothing in the job folder
