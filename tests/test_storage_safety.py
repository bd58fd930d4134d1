"""Nothing lost in storage, nothing leaked on the way: private staging folders (a planted link is never followed),
one live attempt per output.dir in a bucket across machines (the lease), a deadline on every store call (a silent
endpoint, an unreachable gs://, a dead Ray address), credentials never taken inside a URI, a FIFO never read as a
job file. The faults come from a proxy in front of the real S3 API (tests/s3_server.py FaultProxy).

The cluster-tier cases ride on real runs: SIGTERM during a held upload (then the next run ships what it left),
and (in test_storage.py) a second driver refused while the first trains."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raytf.driver import lease as leases
from raytf.errors import SpecError
from raytf.storage import Folder, StorageTimeout, new_staging, own_staging, shown, uri_problem, within
from tests.conftest import base_spec, write_job

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.timeout(120)


def raytf_cli(*args, cwd, env=None, timeout=90) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "raytf"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---------------------------------------------------------------- pure: URIs, leases, staging folders


@pytest.mark.parametrize("where, says", [
    ("s3://", "names no bucket or host; give s3://<bucket>/<path>"),
    ("gs:///path", "names no bucket or host"),
    ("s3://AKIAKEY:s3cr3t@bucket/runs/m", "carries credentials before '@'"),
    ("s3://s3cr3t@bucket/runs/m", "carries credentials before '@'"),
    ("s3://AKIAKEY:s3cr3t/with+slash@bucket/runs/m", "carries credentials before '@'"),  # AWS secrets hold '/'
    ("hdfs://etl@namenode:8020/runs", None),  # a user name, not a secret
    ("s3://bucket/runs/m", None), ("hdfs://namenode:8020/runs", None), ("runs/m", None), ("file:///tmp/x", None),
])
def test_a_storage_uri_without_a_bucket_or_with_credentials_is_refused_without_repeating_them(where, says):
    problem = uri_problem(where)
    assert (problem is None) if says is None else (says in problem)
    assert "s3cr3t" not in (problem or "") and "s3cr3t" not in shown(where)


def test_a_lease_keeps_others_out_until_it_is_released_expires_or_its_process_on_this_machine_is_gone():
    live = {"owner": "a", "host": "h1", "pid": 10, "expires": 1000.0, "released": False, "started": "t"}
    alive, dead = (lambda pid: True), (lambda pid: False)
    assert "pid 10 on h1" in leases.blocker(live, "h2", 900.0, dead)  # another machine: its pid says nothing here
    assert "pid 10 on h1" in leases.blocker(live, "h1", 900.0, alive)
    assert leases.blocker(live, "h1", 900.0, dead) is None  # killed on this machine: free at once
    assert leases.blocker(live, "h2", 1000.5, alive) is None  # expired
    assert leases.blocker({**live, "released": True}, "h2", 900.0, alive) is None
    assert leases.blocker(None, "h2", 900.0, alive) is None and leases.blocker([1], "h2", 0.0, alive) is None


def test_a_staging_folder_is_private_and_only_a_real_one_with_its_token_is_ever_adopted(tmp_path):
    folder, token = new_staging("m")
    try:
        assert folder.parent == Path(tempfile.gettempdir()) and oct(os.stat(folder).st_mode & 0o777) == "0o700"
        assert own_staging(str(folder), token) == folder
        assert own_staging(str(folder), "another-token") is None
        victim = tmp_path / "victim"
        victim.mkdir(mode=0o700)
        (victim / ".raytf-staging").write_text(token)
        assert own_staging(str(victim), token) is None  # not in the temp dir, not named as raytf names them
        link = Path(tempfile.gettempdir()) / f"raytf-staging-planted-{os.getpid()}"
        link.symlink_to(folder)
        try:
            assert own_staging(str(link), token) is None  # a link to a real one is still a link
        finally:
            link.unlink()
        os.chmod(folder, 0o755)
        assert own_staging(str(folder), token) is None  # not private
    finally:
        os.chmod(folder, 0o700)
        (folder / ".raytf-staging").unlink()
        folder.rmdir()


def test_a_call_past_its_deadline_is_a_timeout_naming_what_waited():
    started = time.monotonic()
    with pytest.raises(StorageTimeout, match=r"output.dir s3://b/m \(reading\) did not answer within 0.5 s"):
        within(0.5, "output.dir s3://b/m (reading)", lambda: time.sleep(30))
    assert time.monotonic() - started < 2


# ---------------------------------------------------------------- a real S3 API behind a faulty proxy


def test_two_drivers_on_one_bucket_the_second_is_refused_and_only_the_holder_writes(s3):
    folder = Folder(f"s3://{s3.bucket()}/runs/m")
    first = leases.Lease.acquire(folder, "m", ttl_s=30, settle_s=0.1)
    try:
        with pytest.raises(leases.LeaseHeld, match=rf"is in use by another run \(pid {os.getpid()} on "):
            leases.Lease.acquire(folder, "m", ttl_s=30, settle_s=0.1)
        assert first.holds()
    finally:
        first.release()
    second = leases.Lease.acquire(folder, "m", ttl_s=0.6, settle_s=0.1)  # released: free
    second._stop.set()  # stops renewing, as a driver cut off from its store would
    time.sleep(1.0)
    third = leases.Lease.acquire(folder, "m", ttl_s=30, settle_s=0.1)  # expired: taken over
    try:
        assert not second.holds() and "pid" in second.lost  # the old holder learns it lost the run
    finally:
        third.release()


@pytest.mark.timeout(60)
def test_a_rank_stuck_writing_to_storage_is_named_storage_io_in_its_hang_report(s3, monkeypatch):
    """What a hang's report (raytf.actor.stacks) says of a thread whose write the endpoint holds: a real
    pyarrow S3 upload through raytf's storage calls, to a proxy that never answers."""
    import threading

    from raytf.actor import stacks
    from tests.s3_server import FaultProxy

    proxy = FaultProxy(s3.endpoint).fault("hold", match="PUT ")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    folder = Folder(f"s3://{s3.bucket()}/ckpt", timeout_s=30)
    def write():
        try:
            folder.write_bytes("raytf.json", b"{}")
        except Exception:  # the proxy goes away at the end: the write fails, as it should
            pass

    writer = threading.Thread(target=write, daemon=True)
    try:
        writer.start()
        deadline = time.monotonic() + 20
        while proxy.held < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proxy.held >= 1
        threads = stacks.snapshot(writer.ident)
        doing, where, _ = stacks.summary(threads)
        assert doing == "storage I/O" and where.startswith("storage.py:"), (doing, where)
    finally:
        proxy.close()  # the write fails (after pyarrow's retries, in the background)


def test_a_silent_endpoint_is_an_error_within_the_deadline_not_a_hang(s3, job_dir):
    from tests.s3_server import FaultProxy

    proxy = FaultProxy(s3.endpoint).fault("hold")
    bucket = s3.bucket()
    try:
        env = {"AWS_ENDPOINT_URL": proxy.endpoint, "RAYTF_STORAGE_TIMEOUT_S": "1"}
        started = time.monotonic()
        shown_run = raytf_cli("results", f"s3://{bucket}/runs/m", cwd=Path.cwd(), env=env, timeout=30)
        took = time.monotonic() - started
        assert shown_run.returncode == 5, shown_run.stderr  # the storage unreadable (raytf results' code)
        lines = shown_run.stderr.strip().splitlines()
        assert len(lines) == 1 and f"({proxy.endpoint}, " in lines[0] and "did not answer within 1 s" in lines[0]
        assert took < 15 and proxy.held >= 1
        write_job(job_dir, base_spec())
        started = time.monotonic()
        run = raytf_cli("run", "job.yaml", "--set", f"output.dir=s3://{bucket}/runs/m", cwd=job_dir, env=env,
                        timeout=30)
        assert run.returncode == 1 and time.monotonic() - started < 15, run.stderr
        assert run.stderr.strip().splitlines() == [line for line in run.stderr.strip().splitlines()
                                                   if line.startswith("raytf: error: output.dir")]
        assert "did not answer within 1 s" in run.stderr
    finally:
        proxy.close()


# ---------------------------------------------------------------- the console script, before training


@pytest.mark.parametrize("where, says", [
    ("s3://", "output.dir: the URI names no bucket or host"),
    ("s3://AKIAKEY:s3cr3t@bucket/runs/m", "output.dir: the URI carries credentials"),
])
def test_a_uri_without_a_bucket_or_with_credentials_is_exit_2_and_leaves_nothing(job_dir, where, says):
    write_job(job_dir, base_spec())
    before = sorted(p.name for p in job_dir.iterdir())
    proc = raytf_cli("run", "job.yaml", "--set", f"output.dir={where}", cwd=job_dir)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "s3cr3t" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in job_dir.iterdir()) == before  # no folder named "s3:"


def test_an_unreachable_gs_bucket_is_an_error_within_the_deadline(job_dir):
    write_job(job_dir, base_spec())
    started = time.monotonic()
    proc = raytf_cli("run", "job.yaml", "--set", "output.dir=gs://raytf-no-network/runs/m", cwd=job_dir,
                     env={"RAYTF_STORAGE_TIMEOUT_S": "3"}, timeout=60)
    assert time.monotonic() - started < 30
    assert proc.returncode in (1, 2) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("raytf: error: ") and "gs://raytf-no-network" in proc.stderr


def test_a_fifo_as_the_job_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    proc = raytf_cli("run", str(fifo), cwd=tmp_path, timeout=30)
    assert proc.returncode == 2 and "not a regular file" in proc.stderr, proc.stderr
    assert "released" not in proc.stderr


def test_a_planted_link_at_the_old_staging_path_is_never_followed_and_a_dead_ray_address_is_one_line(
        s3, job_dir, tmp_path):
    """Someone plants links where raytf used to stage (a guessable path in a shared temp folder); the run
    stages in a private folder of its own, and the victim's files are neither uploaded nor deleted. The run
    then meets an address where no Ray listens: one line, exit 1, in seconds; no result.json says "running",
    and the staging folder is gone."""
    shared = tmp_path / "shared-tmp"
    victim = tmp_path / "victim"
    (shared / "raytf-staging").mkdir(parents=True)
    victim.mkdir()
    (victim / "id_rsa").write_text("secret key")
    out = f"s3://{s3.bucket()}/runs/r7"
    digest = hashlib.sha1(out.encode()).hexdigest()[:12]
    (shared / "raytf-staging" / f"t-{digest}").symlink_to(victim)
    write_job(job_dir, base_spec())

    started = time.monotonic()
    proc = raytf_cli("run", "job.yaml", "--set", f"output.dir={out}", "--address", "127.0.0.1:9", cwd=job_dir,
                     env={"TMPDIR": str(shared)})
    assert time.monotonic() - started < 60
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("raytf: error: no Ray cluster answers at 127.0.0.1:9")
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["id_rsa"] and (victim / "id_rsa").read_text() == "secret key"
    stored = s3.files(out)
    assert "id_rsa" not in stored and "result.json" not in stored  # no attempt began: nothing says "running"
    assert sorted(p.name for p in shared.iterdir()) == ["raytf-staging"]  # no staging folder left behind
    lease = json.loads(s3.read(f"{out}/{leases.LEASE}"))
    assert lease["released"] and lease["staging"] is None


# ---------------------------------------------------------------- a real run: SIGTERM while its results ship


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_sigterm_during_a_held_upload_is_one_line_and_the_next_run_ships_what_it_left(s3, cluster, job_dir, tmp_path):
    """A one-epoch run whose model upload the store holds: SIGTERM ends it within seconds, saying where the
    results are; result.json in the bucket says interrupted, not running. The same command again (resume: auto)
    ships the staged results first, finds the run succeeded and trains nothing. (On the session's cluster: the
    upload and the signal are the driver's; a signal to an embedded Ray's driver: tests/test_real_code.py.)"""
    from tests.s3_server import FaultProxy

    proxy = FaultProxy(s3.endpoint).fault("hold", match=r"^PUT \S*model\.keras")
    out = f"s3://{s3.bucket()}/runs/m"
    write_job(job_dir, base_spec(name="m", train={"epochs": 1, "global_batch_size": 64, "seed": 0},
                                 cluster={"workers": 1, "cpus_per_worker": 0.5}, output={"dir": out}))
    command = [str(BIN / "raytf"), "run", "job.yaml", "--resume", "auto"]
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, "RAY_AUTH_MODE": "disabled"}
    try:
        first = subprocess.Popen(command + ["--address", cluster[0].address], cwd=job_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
        deadline = time.time() + 200
        while proxy.held == 0:
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        signalled = time.monotonic()
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=30)
        assert time.monotonic() - signalled < 10
    finally:
        proxy.close()
    assert first.returncode == 143, stderr[-3000:]
    kept = [line for line in stderr.splitlines() if "could not all be written to output.dir" in line]
    assert len(kept) == 1 and "(interrupted); they are kept in " in kept[0], stderr[-3000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith("raytf: interrupted")
    said = json.loads(s3.read(f"{out}/result.json"))
    assert said["status"] == "interrupted" and said["attempts"][-1]["ended"]
    staging = kept[0].split("they are kept in ", 1)[1].split(" on ", 1)[0]
    assert (Path(staging) / "model.keras").is_file() and "model.keras" not in s3.files(out)

    second = subprocess.run(command, cwd=job_dir, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"an earlier attempt left in {staging} to output.dir {out}" in second.stderr
    assert "already succeeded" in second.stderr and "workers' logs" not in second.stderr  # nothing trained
    result = json.loads(s3.read(f"{out}/result.json"))
    assert result["status"] == "succeeded" and "model.keras" in s3.files(out)
    assert not Path(staging).exists()
