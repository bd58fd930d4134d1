"""`raytf submit | status | logs | stop` against a real `ray start --head` with its dashboard (the Jobs API)
and Ray token authentication on, as on a cluster made by `ray up cluster.yaml`."""
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from raytf import submit as jobs_api
from tests.conftest import REPO, base_spec, write_job
from tests.ray_head import Head, free_port, group_alive, head_answers, head_report, start_head, stop_head


class HeadDied(Exception):
    """The test's own Ray head stopped answering (`ray start --block` ends the head when any of its Ray
    processes dies): seen once in CI while a submitted job's runtime env was still being set up, before
    any raytf code ran. The message holds the head's logs; the test runs once more, on a fresh head."""


pytestmark = [pytest.mark.timeout(60),  # the tests that start jobs say how long they may take
              pytest.mark.flaky(reruns=1, only_rerun=[HeadDied])]


@pytest.fixture(scope="module")
def live_head(s3):
    """The module's head, shared by its tests. A test that finds it gone gets a new one (the test it
    died in has already failed with HeadDied), so one crash of Ray's head costs one test a rerun."""
    heads = []

    def current() -> Head:
        if heads and head_answers(heads[-1]):
            return heads[-1]
        if heads:
            stop_head(heads[-1].proc, heads[-1])
        heads.append(start_head(["--num-cpus=3", "--num-gpus=2"], extra_env=s3.env)[0])  # the cluster reaches S3
        return heads[-1]

    yield current
    if heads:
        stop_head(heads[-1].proc, heads[-1])
    for h in heads:
        assert not group_alive(h.proc.pid), "the Ray head's processes outlived the test module"


@pytest.fixture
def head(live_head) -> Head:
    return live_head()


def cli(head: Head, *args, timeout=240, cwd=REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", *args], env=head.env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
    if proc.returncode == jobs_api.EXIT_UNREACHABLE:  # the test's own head is meant to be up
        check_head(head)
    return proc


def check_head(head: Head) -> None:
    if not head_answers(head):
        raise HeadDied(head_report(head))


STATE_QUERY = textwrap.dedent('''
    import json, sys, time
    from ray.util.state import list_actors, list_placement_groups

    address, want, deadline = sys.argv[1], sys.argv[2], time.time() + float(sys.argv[3])
    while True:
        actors = list_actors(address=address, filters=[("class_name", "=", "TaskActor")], limit=1000,
                             raise_on_missing_output=False)
        alive = sum(a.state == "ALIVE" for a in actors)
        groups = [g.state for g in list_placement_groups(address=address, raise_on_missing_output=False)
                  if g.state != "REMOVED"]
        done = alive >= 2 if want == "running" else (alive == 0 and not groups)
        if done or time.time() > deadline:
            print(json.dumps({"alive_task_actors": alive, "live_placement_groups": groups}))
            sys.exit(0 if done else 1)
        time.sleep(1)
''')


def wait_for_actors(head: Head, want: str, deadline_s: float) -> dict:
    """Poll Ray's state API until raytf's actors are running ('running') or all gone ('gone')."""
    proc = subprocess.run([sys.executable, "-c", STATE_QUERY, head.address, want, str(deadline_s)], env=head.env,
                          capture_output=True, text=True, timeout=deadline_s + 60)
    if proc.returncode != 0:
        check_head(head)
    assert proc.returncode == 0, f"actors not {want} after {deadline_s}s: {proc.stdout} {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def submission_id(proc: subprocess.CompletedProcess) -> str:
    match = re.search(r"raytf: submitted (raytf-t-[0-9a-f]{8}) to ", proc.stderr)
    assert match, proc.stderr[-3000:]
    return match.group(1)


# ---------------------------------------------------------------- against the cluster


WRITING_MODEL = textwrap.dedent('''
    """Writes a file into its own folder when imported: on the cluster that folder is the job's working
    copy, so the driver's package of it differs from the one submitted and is uploaded again from there."""
    import pathlib, time
    pathlib.Path("written_by_the_job.txt").write_text(str(time.time()))
    from tmodel import build_model
''')


@pytest.mark.cluster
@pytest.mark.timeout(360)
def test_submit_from_the_job_folder_runs_a_two_worker_job_to_success_and_leaves_no_package_behind(head, job_dir, s3):
    """Submitted from inside its folder, as users do; the job's model writes into that folder on import, so
    on the cluster the driver's package of its working copy differs and is uploaded again from there. Its
    output.dir is a bucket: the results outlive the head's temporary working copy, and `raytf results` and
    `raytf status` read them from there."""
    (job_dir / "writing.py").write_text(WRITING_MODEL)
    out = f"s3://{s3.bucket()}/runs/t"
    write_job(job_dir, base_spec(model="writing:build_model", output={"dir": out}))
    before = {p.name for p in job_dir.iterdir()}
    proc = cli(head, "submit", "job.yaml", "--address", head.address, "--set", "train.epochs=1", cwd=job_dir)

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_id = submission_id(proc)
    assert "raytf: t succeeded" in proc.stdout  # the driver's own lines, followed live
    assert "epoch 1 done" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == f"raytf: job {job_id} SUCCEEDED"
    assert f"raytf: results go to {out} (`raytf results {out}` reads them)" in proc.stderr
    result = json.loads(s3.read(f"{out}/result.json"))
    assert result["status"] == "succeeded" and len(result["history"]) == 1  # --set reached the cluster
    assert {"result.json", "model.keras"} <= set(s3.files(out))
    shown = cli(head, "results", out, timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith(f"t: succeeded -- {out}/result.json"), shown.stderr
    assert [t["rank"] for t in result["tasks"]] == [0, 1]
    assert len({t["weights_digest"] for t in result["tasks"]}) == 1

    status = cli(head, "status", job_id, "--address", head.address, timeout=60)
    assert status.returncode == 0 and status.stdout.startswith(f"raytf: job {job_id} SUCCEEDED"), status.stderr
    assert "entrypoint: raytf run job.yaml --set train.epochs=1" in status.stdout
    assert f"  run: t: succeeded -- {out}/result.json" in status.stdout  # the run's own state, from the bucket
    logs = cli(head, "logs", job_id, "--address", head.address, timeout=60)
    assert logs.returncode == 0 and "raytf: t succeeded" in logs.stdout

    copies = [p.parent for p in (Path(head.temp_dir) / "session_latest" / "runtime_resources").rglob("writing.py")]
    assert copies  # the job's working copy on the head, where its driver ran
    for copy in copies:
        assert not list(copy.rglob("*.zip")), f"a package was built inside the working copy {copy}"
        assert not list(copy.rglob("result.json")), f"results in the head's working copy {copy}"
    assert {p.name for p in job_dir.iterdir()} == before  # nothing appeared where the user stood
    wait_for_actors(head, "gone", 30)


FAILING_MODEL = textwrap.dedent('''
    import json, os
    from tmodel import build_model as _build

    def build_model():
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            raise ValueError("boom on rank 1")
        return _build()
''')


@pytest.mark.cluster
@pytest.mark.timeout(360)
def test_a_failing_job_makes_submit_exit_1_with_the_cause(head, job_dir):
    (job_dir / "failing.py").write_text(FAILING_MODEL)
    path = write_job(job_dir, base_spec(model="failing:build_model", train={"epochs": 1}))
    proc = cli(head, "submit", str(path), "--address", head.address)

    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_id = submission_id(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"raytf: job {job_id} FAILED (exit code 1): training failed: rank(s) 1: "
                           f"failing.py:7: ValueError: boom on rank 1"), last
    status = cli(head, "status", job_id, "--address", head.address, timeout=60)
    assert "boom on rank 1" in status.stdout
    wait_for_actors(head, "gone", 30)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_drivers_exit_code_reaches_the_submitter(head, job_dir):
    """One real case (a spec the cluster finds bad: 2); every other code's mapping is
    test_exit_code_follows_the_driver, and exit 3 itself is test_cluster's GPUs-that-do-not-exist run."""
    code, says = 2, "model: module 'nosuchmodule' not found"
    # well-formed, so it passes the local check; the cluster finds the module missing
    spec = base_spec(model="nosuchmodule:build_model")
    proc = cli(head, "submit", str(write_job(job_dir, spec)), "--address", head.address)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"FAILED (exit code {code}): " in last and says in last, last


@pytest.mark.cluster
@pytest.mark.timeout(360)
def test_stop_ends_a_running_job_and_frees_its_actors(head, job_dir):
    path = write_job(job_dir, base_spec(train={"epochs": 1000}))
    proc = cli(head, "submit", str(path), "--address", head.address, "--no-wait", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = proc.stdout.strip()
    assert job_id == submission_id(proc)

    running = wait_for_actors(head, "running", 180)
    assert running["alive_task_actors"] == 2 and running["live_placement_groups"] == ["CREATED"]
    assert "RUNNING" in cli(head, "status", job_id, "--address", head.address, timeout=60).stdout

    started = time.time()
    stopped = cli(head, "stop", job_id, "--address", head.address, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip().startswith(f"raytf: job {job_id} STOPPED"), stopped.stdout
    gone = wait_for_actors(head, "gone", 60)
    assert gone == {"alive_task_actors": 0, "live_placement_groups": []}
    assert time.time() - started < 90

    again = cli(head, "stop", job_id, "--address", head.address, timeout=60)
    assert again.returncode == 0 and "had already ended: STOPPED" in again.stdout
    follow = cli(head, "logs", job_id, "--follow", "--address", head.address, timeout=60)
    assert follow.returncode == jobs_api.EXIT_STOPPED, follow.stderr


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_without_the_token_the_error_says_how_to_send_it(head, tmp_path):
    env = {k: v for k, v in head.env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env["HOME"] = str(tmp_path)  # a user with no ~/.ray/auth_token
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "status", "raytf-t-00000000", "--address", head.address],
                          env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == jobs_api.EXIT_UNREACHABLE
    assert "requires token authentication" in proc.stderr and "~/.ray/auth_token" in proc.stderr
    assert "Traceback" not in proc.stderr
    wrong = {**head.env, "RAY_AUTH_TOKEN": "0" * 64}
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "status", "raytf-t-00000000", "--address", head.address],
                          env=wrong, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == jobs_api.EXIT_UNREACHABLE and "refused raytf's token" in proc.stderr
    missing = cli(head, "status", "raytf-t-00000000", "--address", head.address, timeout=60)
    assert missing.returncode == 1 and "no job 'raytf-t-00000000'" in missing.stderr


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_an_explicit_address_to_a_token_cluster_needs_only_the_users_token_file(head, job_dir, tmp_path):
    """No RAY_AUTH_MODE exported: the user's token file is enough, for `run --address` and for `status`."""
    token_file = tmp_path / "auth_token"
    token_file.write_text(head.env["RAY_AUTH_TOKEN"])
    env = {k: v for k, v in head.env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    path = write_job(job_dir, base_spec(train={"epochs": 1}, output={"dir": str(job_dir / "out")},
                                        cluster={"workers": 1}))  # what is tested is the token, not the job
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "run", str(path), "--address", head.gcs_address],
                          env=env, capture_output=True, text=True, timeout=200, cwd=job_dir)
    if proc.returncode != 0:
        check_head(head)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((job_dir / "out" / "result.json").read_text())["status"] == "succeeded"
    status = subprocess.run([sys.executable, "-m", "raytf.cli", "status", "raytf-t-00000000", "--address",
                             head.address], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert status.returncode == 1 and "no job 'raytf-t-00000000'" in status.stderr  # authenticated, then answered
    wait_for_actors(head, "gone", 30)


FOLLOW_A_CLUSTER_THAT_DIES = textwrap.dedent('''
    import sys
    from raytf import submit as jobs_api

    jobs_api.LOST_CONTACT_S = 5.0  # the deadline under test, shortened
    jobs = jobs_api.Jobs(sys.argv[1])
    job_id = jobs.client.submit_job(entrypoint="echo started; sleep 600")
    try:
        jobs.follow(job_id, note=lambda text: print(text, flush=True))
    except jobs_api.ClusterUnreachable as exc:
        print("unreachable:", exc, flush=True)
        sys.exit(5)
''')


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_following_a_cluster_that_goes_away_ends_with_a_clear_error_not_a_hang(live_head):
    """The module's shared head, stopped here (the module's last test that needs it: a test after this one
    would get a fresh head from live_head)."""
    h = live_head()
    head_proc = h.proc
    try:
        follower = subprocess.Popen([sys.executable, "-c", FOLLOW_A_CLUSTER_THAT_DIES, h.address], env=h.env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in follower.stdout:  # the job's own output arrives through the log stream
            seen.append(line)
            if line.strip() == "started":
                break
        assert seen and seen[-1].strip() == "started", "".join(seen)[-3000:]
    finally:
        stop_head(head_proc, h)  # the whole cluster disappears mid-job
    died = time.time()
    rest = follower.communicate(timeout=120)[0]
    assert follower.returncode == 5, rest[-3000:]
    assert "unreachable: lost contact with http://127.0.0.1:" in rest and "raytf status raysubmit_" in rest
    assert time.time() - died < 60  # LOST_CONTACT_S plus a poll or two, not forever


# ---------------------------------------------------------------- no cluster needed


@pytest.mark.timeout(60)
def test_an_unreachable_address_is_one_line_and_exit_5(job_dir):
    path = write_job(job_dir, base_spec())
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "submit", str(path), "--address",
                           f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == jobs_api.EXIT_UNREACHABLE
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Ray Jobs API at http://127.0.0.1:" in lines[0], proc.stderr
    assert "connection refused" in lines[0] and "ray dashboard cluster.yaml" in lines[0]
    assert time.time() - started < 30


@pytest.mark.timeout(60)
def test_a_malformed_spec_fails_before_any_network(job_dir):
    path = write_job(job_dir, base_spec(train={"epochs": 0}))
    proc = subprocess.run([sys.executable, "-m", "raytf.cli", "submit", str(path), "--address", "http://192.0.2.1:9"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "train.epochs" in proc.stderr and "Traceback" not in proc.stderr


def test_prepare_builds_the_entrypoint_and_ships_the_job_folder_without_old_results(job_dir):
    path = write_job(job_dir, base_spec(), name="my job.yaml")
    sub = jobs_api.prepare(path, ["train.epochs=3", "optimizer.name=sgd w"])
    assert sub.entrypoint == "raytf run 'my job.yaml' --set train.epochs=3 --set 'optimizer.name=sgd w'"
    assert sub.runtime_env["working_dir"] == str(job_dir)
    assert "/runs/t" in sub.runtime_env["excludes"]  # output.dir default: runs/<name> in the job folder
    assert re.fullmatch(r"raytf-t-[0-9a-f]{8}", sub.submission_id)
    assert "py_modules" not in sub.runtime_env  # tmodel.py is in the job folder


@pytest.mark.parametrize("status, driver_code, expected", [
    ("SUCCEEDED", 0, 0), ("FAILED", 1, 1), ("FAILED", 2, 2), ("FAILED", 3, 3), ("FAILED", None, 1),
    ("FAILED", -9, 137), ("STOPPED", None, jobs_api.EXIT_STOPPED),
])
def test_exit_code_follows_the_driver(status, driver_code, expected):
    from ray.job_submission import JobDetails

    info = JobDetails(type="SUBMISSION", status=status, entrypoint="raytf run job.yaml", driver_exit_code=driver_code,
                      message="Job entrypoint command failed with exit code 2, last available logs (truncated to "
                              "20,000 chars):\nraytf: error: data.train: no such file\n")
    assert jobs_api.exit_code(info) == expected
    if status == "FAILED":
        assert jobs_api.cause(info) == "data.train: no such file"


def test_an_explicit_address_beats_ray_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.1:8265")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    assert jobs_api.resolve_address("127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert jobs_api.resolve_address(None) == "http://10.0.0.1:8265"
    monkeypatch.delenv("RAY_ADDRESS")
    assert jobs_api.resolve_address(None) == jobs_api.DEFAULT_ADDRESS


def test_a_head_whose_job_agent_is_not_up_yet_is_asked_again_until_a_deadline(job_dir, monkeypatch):
    # Ray's head answers 500 "No available agent" while its job agent has not registered (seen in CI under load)
    answers = ["raysubmit_ok"]

    class StartingHead:
        def __init__(self, refusals):
            self.refusals = refusals

        def submit_job(self, **kwargs):
            if self.refusals:
                self.refusals -= 1
                raise RuntimeError("Request failed with status code 500: No available agent to submit job, "
                                   "please try again later..")
            return answers[0]

    monkeypatch.setattr(jobs_api.time, "sleep", lambda s: None)
    jobs = object.__new__(jobs_api.Jobs)
    jobs.address, jobs.read_timeout_s, jobs.token_withheld = "http://127.0.0.1:8265", 1.0, False
    sub = jobs_api.prepare(write_job(job_dir, base_spec()))
    jobs.client = StartingHead(refusals=3)
    assert jobs.submit(sub) == "raysubmit_ok"
    jobs.client = StartingHead(refusals=10 ** 6)  # never up: one line, after the deadline
    with pytest.raises(jobs_api.ClusterUnreachable, match="while submitting .*No available agent"):
        jobs.submit(sub, agent_wait_s=0.05)
