"""Bad input to `raytf results` and to the checkpoint listing: one line naming the place and the fix, never a
traceback. result.json of other types, a path pyarrow refuses (exit 2); a store whose endpoint is down or that
refuses the credentials (exit 5, never read as a failed run's 1); a checkpoint whose raytf.json is not raytf's,
passed over for the one before; a listing that fails, an error rather than "no checkpoint".

The CLI runs as the real `raytf` console script; storage is a local folder or the in-process S3 server of
tests/s3_server.py. No Ray, no TensorFlow."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from raytf.checkpoint import META, Storage, resume_note
from raytf.errors import RaytfError

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.timeout(90)


def raytf_results(*args, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "raytf"), "results", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=80, env={**os.environ, **(env or {})})


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The whole of stderr, which must be one `raytf: error:` line."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raytf: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def refuse(s3, monkeypatch):
    """refuse(): the S3 server checks credentials from then to the test's end. The tests' keys exist in no
    account, so every request is refused (403), as a real store refuses wrong or expired keys."""
    import moto.settings

    return lambda: monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)


def s3_run(s3, result: bytes | None = None) -> str:
    """A run's output.dir in a new bucket, holding `result` as its result.json."""
    out = f"s3://{s3.bucket()}/runs/m"
    if result is not None:
        with s3.fs().open_output_stream(out.removeprefix("s3://") + "/result.json") as f:
            f.write(result)
    return out


# ---------------------------------------------------------------- raytf results: the user's input, exit 2

GOOD = {"name": "m", "status": "failed", "error": "boom", "history": [{"epoch": 1, "loss": 0.5}], "exports": {},
        "attempts": [{"attempt": 1, "cluster": {"session": "s"}, "host": "h", "started": "t0", "ended": "t1",
                      "ended_because": "failed: boom"}]}


@pytest.mark.parametrize("content, says", [
    pytest.param(json.dumps({**GOOD, "attempts": [1]}), '"attempts" holds 1 (a number), not an object', id="attempts"),
    pytest.param(json.dumps({**GOOD, "history": "x"}), '"history" is "x" (a string), not a list', id="history"),
    pytest.param(json.dumps([GOOD]), "it holds a list where raytf writes an object", id="top-level-list"),
    pytest.param(json.dumps({**GOOD, "exports": ["model.keras"]}),
                 '"exports" is ["model.keras"] (a list), not an object', id="exports"),
    pytest.param(json.dumps({**GOOD, "attempts": [{**GOOD["attempts"][0], "cluster": "c"}]}),
                 'an attempt\'s "cluster" is "c" (a string), not an object', id="cluster"),
    pytest.param(json.dumps({**GOOD, "status": 3}), '"status" is 3 (a number), not a string', id="status"),
    pytest.param(json.dumps(GOOD)[:40], "is not JSON (Unterminated string", id="cut-short"),
    pytest.param("[" * 100_000, "is not JSON (", id="nested-past-recursion-limit"),
])
def test_a_result_json_of_other_types_is_one_line_naming_it_and_exit_2(tmp_path, content, says):
    out = tmp_path / "runs" / "m"
    out.mkdir(parents=True)
    (out / "result.json").write_text(content)
    for run in (str(out), "m"):  # the output.dir, and the run's name (runs/<name> here)
        proc = raytf_results(run, cwd=tmp_path)
        line = one_line(proc)
        assert proc.returncode == 2, line
        assert line.startswith(f"raytf: error: {out}/result.json is not ") and says in line, line
        assert "restore it, or run the job again" in line
    as_json = raytf_results(str(out), "--json", cwd=tmp_path)  # --json reads it the same way
    assert as_json.returncode == 2 and one_line(as_json) == line


def test_a_result_json_of_other_types_in_a_bucket_is_the_same_line(s3, tmp_path):
    out = s3_run(s3, json.dumps({**GOOD, "attempts": [1]}).encode())
    proc = raytf_results(out, cwd=tmp_path)
    assert proc.returncode == 2
    assert one_line(proc).startswith(f"raytf: error: {out}/result.json is not a raytf result: \"attempts\" holds 1")
    good = s3_run(s3, json.dumps(GOOD).encode())  # and a good one still reads, its run failed: exit 1
    shown = raytf_results(good + "/", cwd=tmp_path)
    assert shown.returncode == 1 and shown.stdout.startswith(f"m: failed (boom) -- {good}/result.json"), shown.stderr


def test_a_uri_pyarrow_refuses_is_one_line_and_exit_2(s3, tmp_path):
    out = f"s3://{s3.bucket()}/runs//m"  # an empty path component
    proc = raytf_results(out, cwd=tmp_path)
    line = one_line(proc)
    assert proc.returncode == 2 and line.startswith(f"raytf: error: output.dir {out}: pyarrow refuses the path")
    assert "Empty path component" in line and "no empty parts" in line


# ---------------------------------------------------------------- raytf results: the environment, exit 5


def test_a_dead_endpoint_is_one_line_naming_it_and_exit_5(s3, tmp_path):
    out = s3_run(s3, json.dumps(GOOD).encode())
    endpoint = f"http://127.0.0.1:{closed_port()}"
    proc = raytf_results(out, cwd=tmp_path, env={"AWS_ENDPOINT_URL": endpoint})
    line = one_line(proc)
    assert proc.returncode == 5, line  # not 1: that is the run's own "failed"
    assert line.startswith(f"raytf: error: cannot read {out}/result.json (")
    assert f"the S3 endpoint {endpoint} (AWS_ENDPOINT_URL) does not answer: start it, or fix AWS_ENDPOINT_URL" in line


def test_refused_credentials_are_one_line_naming_them_and_exit_5(s3, tmp_path, refuse):
    out = s3_run(s3, json.dumps(GOOD).encode())
    refuse()
    proc = raytf_results(out, cwd=tmp_path)
    line = one_line(proc)
    assert proc.returncode == 5, line
    assert line.startswith(f"raytf: error: cannot read {out}/result.json (") and "ACCESS_DENIED" in line
    assert "the store refused the credentials: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line


# ---------------------------------------------------------------- checkpoints: a raytf.json that is not raytf's


def meta(step: int, **changed) -> dict:
    return {"step": step, "epoch": 1, "step_in_epoch": step, "history": [], "world_size": 2, **changed}


def checkpoint(root: Path, step: int, raytf_json: str) -> Path:
    folder = root / f"ckpt-{step:012d}"
    folder.mkdir(parents=True)
    (folder / "state.index").write_bytes(b"weights")
    (folder / META).write_text(raytf_json)
    return folder


@pytest.mark.parametrize("newest, says", [
    pytest.param("{}", 'has no "step"', id="empty"),
    pytest.param(json.dumps({"epoch": 1, "step_in_epoch": 0}), 'has no "step"', id="no-step"),
    pytest.param(json.dumps({**meta(16), "step": "16"}), 'has "step": "16", not a whole number', id="step-string"),
    pytest.param(json.dumps(meta(16, epoch=None)), 'has "epoch": null, not a whole number', id="epoch-null"),
    pytest.param(json.dumps(meta(16, step_in_epoch=-1)), 'has "step_in_epoch": -1, not a whole number',
                 id="negative"),
    pytest.param(json.dumps(meta(16, world_size=True)), 'has "world_size": true, not a whole number', id="bool"),
    pytest.param(json.dumps(meta(16, history="x")), '"history" is not a list of objects', id="history"),
    pytest.param(json.dumps([meta(16)]), "is not a JSON object", id="list"),
    pytest.param(json.dumps(meta(16))[:20], "is not JSON (a write cut short)", id="cut-short"),
])
def test_a_newest_checkpoint_whose_raytf_json_is_not_raytfs_is_skipped_saying_so_once(tmp_path, capsys, newest,
                                                                                      says):
    root = tmp_path / "ckpts"
    checkpoint(root, 8, json.dumps(meta(8)))
    bad = checkpoint(root, 16, newest)
    storage = Storage(str(root))

    latest = storage.latest()
    assert latest is not None and latest.step == 8 and latest.path == str(root / "ckpt-000000000008")
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned == [f"raytf: skipping checkpoint {bad}: its raytf.json {says}; the checkpoint before it is used "
                      f"instead (repair that raytf.json or remove the folder)"]
    assert [c.step for c in storage.list()] == [8]
    assert capsys.readouterr().err == ""  # polled again: said once
    assert resume_note(str(root), "auto").startswith("raytf: resume: auto: continuing from step 8")


def test_a_checkpoint_without_raytf_json_is_incomplete_and_passed_over_quietly(tmp_path, capsys):
    root = tmp_path / "ckpts"
    checkpoint(root, 8, json.dumps(meta(8)))
    (root / "ckpt-000000000016").mkdir()  # an upload cut short before raytf.json
    assert Storage(str(root)).latest().step == 8
    assert capsys.readouterr().err == ""
    assert Storage(str(tmp_path / "never-made")).list() == []  # a folder that does not exist holds none


# ---------------------------------------------------------------- checkpoints: a listing that fails


def test_a_listing_over_a_dead_endpoint_raises_naming_the_folder_not_no_checkpoints(s3, monkeypatch):
    where = f"s3://{s3.bucket()}/ckpts"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    storage = Storage(where)
    with pytest.raises(RaytfError) as raised:
        storage.list()
    said = str(raised.value)
    assert said.startswith(f"checkpoint.dir {where}: cannot list its checkpoints (") and "\n" not in said
    assert "NETWORK_CONNECTION" in said and "check the endpoint (AWS_ENDPOINT_URL)" in said
    assert raised.value.exit_code == 1


def test_a_refused_listing_fails_the_fresh_run_guard_and_resume_instead_of_passing_them(s3, refuse):
    where = f"s3://{s3.bucket()}/ckpts"
    refuse()
    for resume in (False, True, "auto"):  # each read "no checkpoint" before: a start from step 0
        with pytest.raises(RaytfError, match=rf"^checkpoint\.dir {where}: cannot list its checkpoints \(.*ACCESS"):
            resume_note(where, resume)
    Storage(where).prune(1)  # housekeeping after a save: the save stands, the next save prunes


def test_a_restart_whose_checkpoint_listing_fails_fails_the_job_naming_the_folder_never_from_step_0(
        s3, tmp_path, monkeypatch):
    """The endpoint goes away after the run started: the restart cannot list checkpoint.dir, and the job fails
    with that folder and the cause instead of training again from step 0 (the controller stepped over the fakes
    of tests/fakes.py; the checkpoint folder is real, behind a proxy that starts dropping connections)."""
    from raytf.driver.controller import Controller
    from raytf.job import Job, parse
    from tests.conftest import base_spec
    from tests.fakes import FakeClock, FakeResources, Script, actor_died
    from tests.s3_server import FaultProxy

    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("RAYTF_STORAGE_TIMEOUT_S", "5")
    where = f"s3://{s3.bucket()}/ckpts"
    job = Job(spec=parse(base_spec(output={"dir": str(tmp_path / "out"), "tensorboard": False},
                                   checkpoint={"dir": where}, failure={"max_restarts": 2})), job_dir=tmp_path)
    clock = FakeClock()

    def script(attempt, task):
        if attempt == 1 and task.rank == 1:
            proxy.fault("drop")  # the store is gone from the first failure on
            return Script(finish_after=None, fail_after=3.0, error=actor_died())
        return Script(finish_after=6.0)

    world = FakeResources(clock, script)
    try:
        with pytest.raises(RaytfError) as raised:
            Controller(job, world, code=None, clock=clock).run()
    finally:
        proxy.close()
    said = str(raised.value)
    assert said.startswith(f"checkpoint.dir {where}: cannot list its checkpoints (") and "\n" not in said
    assert len(world.payloads) == 1, "no second attempt started (from step 0 or any other)"
    written = json.loads((tmp_path / "out" / "result.json").read_text())
    assert written["status"] == "failed" and written["error"] == said
