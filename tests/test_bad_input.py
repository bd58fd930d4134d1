"""Bad input a careless or hostile user gives: every answer is one short SpecError (exit 2) naming the line or
key and the fix, found before anything starts. Pure: no Ray, no TensorFlow."""
import time

import pytest

from raytf.errors import SpecError
from raytf.job import parse, read_yaml
from tests.conftest import base_spec

pytestmark = pytest.mark.timeout(30)


def job_file(tmp_path, text: str | bytes):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_a_job_file_that_is_not_utf8_names_its_line(tmp_path):
    path = job_file(tmp_path, b"name: t\nmodel: m:f\n# caf\xe9 latin-1\n")
    with pytest.raises(SpecError, match=r"line 3 is not UTF-8 \(byte 0xe9\); save the file as UTF-8"):
        read_yaml(path)


def test_a_key_given_twice_names_both_lines_and_yaml_merges_still_work(tmp_path):
    path = job_file(tmp_path, "name: t\ntrain:\n  epochs: 2\n  seed: 0\n  epochs: 20\n")
    with pytest.raises(SpecError, match=r"line 5: key 'epochs' is given twice \(first on line 3\); keep one"):
        read_yaml(path)
    merged = job_file(tmp_path, "base: &b {epochs: 2, seed: 0}\ntrain:\n  <<: *b\n  epochs: 5\n")
    assert read_yaml(merged)["train"] == {"epochs": 5, "seed": 0}


def test_an_alias_bomb_is_refused_at_once_in_one_short_line(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, (prev, name) in enumerate(zip("abcdefgh", "bcdefghi")):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    path = job_file(tmp_path, "\n".join(lines) + "\n")
    assert path.stat().st_size < 2000
    started = time.perf_counter()
    with pytest.raises(SpecError) as raised:
        read_yaml(path)
    assert time.perf_counter() - started < 2 and len(str(raised.value)) < 300
    assert "expand to more than 100,000 values" in str(raised.value)
    # a few aliases, as people use them, load as before
    assert read_yaml(job_file(tmp_path, "x: &x [1, 2]\ny: *x\n")) == {"x": [1, 2], "y": [1, 2]}


@pytest.mark.parametrize("section,key,value", [
    ("optimizer", "learning_rate", float("inf")),
    ("optimizer", "learning_rate", float("nan")),
    ("cluster", "reserve_timeout_s", float("inf")),
    ("cluster", "cpus_per_worker", float("inf")),
    ("failure", "hang_timeout_s", float("inf")),
])
def test_a_non_finite_number_is_refused_naming_its_key(section, key, value):
    with pytest.raises(SpecError, match=rf"{section}\.{key}: input should be a finite number"):
        parse(base_spec(**{section: {key: value}}))


def test_a_non_finite_optimizer_option_is_refused():
    with pytest.raises(SpecError, match=r"optimizer.options: .*'momentum': inf.* is not a finite number"):
        parse(base_spec(optimizer={"name": "sgd", "learning_rate": 0.1, "options": {"momentum": float("inf")}}))


def test_a_huge_value_is_echoed_cut_short():
    with pytest.raises(SpecError) as raised:
        parse(base_spec(train={"epochs": "x" * 1_000_000}))
    assert len(str(raised.value)) < 600 and "1,000,002 characters" in str(raised.value)



def test_a_nan_or_infinite_epoch_loss_stops_the_job_naming_epoch_step_and_rank_unless_asked_to_go_on():
    from raytf.actor.context import check_loss
    from raytf.errors import NonFiniteLoss

    spec = parse(base_spec())
    check_loss(spec, 0.25, 1, 22, 0)
    with pytest.raises(NonFiniteLoss, match=r"the loss is nan at epoch 3, step 66 \(rank 1\).*learning_rate"):
        check_loss(spec, float("nan"), 3, 66, 1)
    assert NonFiniteLoss(float("inf"), 1, 2, 0).exit_code == 1
    check_loss(parse(base_spec(train={"nonfinite_loss": "continue"})), float("inf"), 1, 22, 0)


def test_result_json_is_strict_json_even_with_nan_metrics(tmp_path):
    import json

    from raytf.driver.report import Result

    Result(name="t", strategy="mirrored", status="failed", output_dir=str(tmp_path),
           history=[{"epoch": 1, "loss": float("nan"), "val_loss": float("-inf"), "accuracy": 0.5}]).write()
    text = (tmp_path / "result.json").read_text()
    strict = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in result.json"))
    assert strict["history"][0] == {"epoch": 1, "loss": None, "val_loss": None, "accuracy": 0.5}


# ---------------------------------------------------------------- output.dir (raytf.driver.output)

def job_at(tmp_path, **output):
    from raytf.job import Job

    (tmp_path / "data").mkdir(exist_ok=True)
    return Job(spec=parse(base_spec(output=output) if output else base_spec()), job_dir=tmp_path)


@pytest.mark.parametrize("given,says", [
    (".", "is the job folder"),
    ("..", "is the job folder or holds it"),
    ("data", "overlaps data.train"),
    ("data/digits-train.parquet", "is a file, not a folder"),
    ("/dev/null", "is a file, not a folder"),
    ("/proc/raytf-out", "cannot be written"),
])
def test_an_unusable_output_dir_is_refused_before_anything_starts(tmp_path, given, says):
    from raytf.driver import output

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits-train.parquet").write_bytes(b"PAR1")
    with pytest.raises(SpecError, match=f"output.dir .*{says}"):
        output.check(job_at(tmp_path, dir=given))


def test_a_job_named_dot_dot_cannot_write_among_its_code(tmp_path):
    from raytf.driver import output
    from raytf.job import Job

    with pytest.raises(SpecError, match="is the job folder"):
        output.check(Job(spec=parse(base_spec(name="..")), job_dir=tmp_path))


HOLD = """
import sys, time
from pathlib import Path
from raytf.driver import output
from raytf.job import Job, parse
from tests.conftest import base_spec
with output.claim(Job(spec=parse(base_spec(output={"dir": sys.argv[1]})), job_dir=Path(sys.argv[2]))):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_one_run_at_a_time_per_output_dir_and_an_earlier_runs_results_are_moved_aside(tmp_path):
    import subprocess
    import sys

    from raytf.driver import output
    from tests.conftest import REPO

    out = tmp_path / "runs" / "t"
    out.mkdir(parents=True)
    (out / "result.json").write_text("{}")
    (out / "model.keras").write_bytes(b"old model")
    (out / "checkpoints").mkdir()
    job = job_at(tmp_path, dir=str(out))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(tmp_path)], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SpecError, match=rf"is in use by another run \(.*\"pid\": {holder.pid}"):
            with output.claim(job):
                pass
    finally:
        holder.communicate("", timeout=20)
    moved = list((out / output.EARLIER).iterdir())
    assert len(moved) == 1 and (moved[0] / "model.keras").read_bytes() == b"old model"
    assert not (out / "model.keras").exists() and (out / "checkpoints").is_dir(), "checkpoints stay for --resume"
    with output.claim(job) as held:  # free again once the first run ended
        assert held.output_dir == out


# ---------------------------------------------------------------- the cluster token (raytf submit)

@pytest.mark.parametrize("url,may", [
    ("http://127.0.0.1:8265", True), ("http://localhost:8265", True), ("http://[::1]:8265", True),
    ("127.0.0.5:8265", True), ("https://10.1.2.3:8265", True),
    ("http://10.1.2.3:8265", False), ("http://head.example.org:8265", False), ("192.168.1.20:8265", False),
])
def test_the_token_travels_over_plain_http_only_to_this_machine(monkeypatch, url, may):
    from raytf.driver.session import ALLOW_HTTP_TOKEN, token_may_travel

    monkeypatch.delenv(ALLOW_HTTP_TOKEN, raising=False)
    assert token_may_travel(url) is may
    assert token_may_travel(url, allowed=True)


# A stand-in Jobs API on loopback that records each request's Authorization header; the client under test
# is told the address is (or is not) one the token may travel to.
STAND_IN = """
import http.server, json, sys, threading
import ray
from raytf import submit
from raytf.driver import session

seen = []

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen.append(self.headers.get("Authorization"))
        body = json.dumps({"version": "4", "ray_version": ray.__version__, "ray_commit": "x"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
if sys.argv[1] == "elsewhere":  # as for http://10.1.2.3: the only thing that differs is this decision
    session.token_may_travel = lambda url, allowed=False: allowed
submit.Jobs(f"http://127.0.0.1:{server.server_address[1]}")
print(json.dumps(seen))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where,sent", [("loopback", True), ("elsewhere", False)])
def test_the_token_is_withheld_on_the_wire_where_it_may_not_travel(tmp_path, where, sent):
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("s3cret" * 8)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAYTF_ALLOW"))}
    env["HOME"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", STAND_IN, where], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    headers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert headers, "the client asked nothing"
    assert all(h == "Bearer " + "s3cret" * 8 for h in headers) if sent else all(h is None for h in headers)


@pytest.mark.parametrize("workers", ["0", "-5", "1000000000"])
def test_data_inspect_refuses_a_worker_count_out_of_range_at_once(workers):
    from click.testing import CliRunner

    from raytf.cli import main
    from tests.conftest import DIGITS

    started = time.perf_counter()
    result = CliRunner().invoke(main, ["data", "inspect", str(DIGITS / "digits-train.parquet"), "-n", workers])
    assert result.exit_code == 2 and "1<=x<=4096" in result.output, result.output
    assert time.perf_counter() - started < 5


def test_a_world_readable_token_file_is_made_private(monkeypatch, tmp_path):
    from raytf.driver.session import keep_token_private

    token = tmp_path / "token"
    token.write_text("t" * 64)
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    keep_token_private()
    assert token.stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- more answers to bad input (found by probing)

@pytest.mark.parametrize("change,says", [
    ({"name": "a" * 5000}, "name: string should have at most 100 characters"),
    ({"output": {"dir": ""}}, "output.dir: string should have at least 1 character"),
    ({"train": {"global_batch_size": 10 ** 30}}, "train.global_batch_size: input should be less than or equal"),
    ({"cluster": {"workers": True}}, "workers: True is yes/no, not a number"),
    ({"optimizer": {"learning_rate": True}}, "learning_rate: True is yes/no, not a number"),
])
def test_values_that_only_look_right_are_refused(change, says):
    with pytest.raises(SpecError) as raised:
        parse(base_spec(**change))
    assert says in str(raised.value) and len(str(raised.value)) < 600, str(raised.value)


@pytest.mark.parametrize("given,says", [(".", "is the job folder"), ("data", "overlaps data.train")])
def test_a_checkpoint_dir_among_the_jobs_code_or_data_is_refused(tmp_path, given, says):
    from raytf.driver import output
    from raytf.job import Job

    (tmp_path / "data").mkdir()
    job = Job(spec=parse(base_spec(checkpoint={"dir": given}, data={"train": "data"})), job_dir=tmp_path)
    with pytest.raises(SpecError, match=f"checkpoint.dir .*{says}"):
        output.check_checkpoint_dir(job)


def test_resume_says_when_there_is_nothing_to_resume_and_needs_a_checkpoint_dir(tmp_path):
    from raytf.checkpoint import resume_note

    with pytest.raises(SpecError, match="--resume: the job has no checkpoint.dir"):
        resume_note(None)
    assert "holds no checkpoint yet; training starts from scratch" in resume_note(str(tmp_path / "empty"))


def test_a_train_fn_that_takes_no_ctx_is_refused_before_anything_starts(job_dir):
    from raytf.job import load
    from tests.conftest import write_job

    (job_dir / "noctx.py").write_text("def train():\n    pass\n")
    raw = base_spec(model=None, train_fn="noctx:train")
    for key in ("loss", "optimizer", "metrics"):
        raw.pop(key)
    path = write_job(job_dir, raw)
    with pytest.raises(SpecError, match=r"train_fn: noctx:train takes \(\), but raytf calls it with one argument"):
        load(path)


def test_a_submit_address_that_is_no_url_is_refused_without_a_lookup():
    from raytf.submit import resolve_address

    with pytest.raises(SpecError, match="--address 'http://not a url' is not a URL"):
        resolve_address("not a url")


def test_synth_criteo_refuses_a_row_count_below_one(tmp_path):
    from click.testing import CliRunner

    from raytf.cli import main

    result = CliRunner().invoke(main, ["data", "synth-criteo", str(tmp_path / "out"), "--rows", "-5"])
    assert result.exit_code == 2 and "x>=1" in result.output and not (tmp_path / "out").exists()


def test_a_keras_structure_error_keeps_its_cause_not_the_argument_bullets():
    from raytf.actor.raised import summary

    message = ("in user code:\n\n    File \"/job/train.py\", line 3, in step\n\nValueError: The structure of `inputs` "
               "doesn't match the expected structure.\nExpected: ['pixels']\nReceived: inputs={'pixels', 'label'}\n\n"
               "Arguments received by Functional.call():\n  • inputs={'pixels': 'tf.Tensor'}\n  • training=True\n"
               "  • kwargs=<class 'inspect._empty'>")
    assert "kwargs" not in summary(message) and "structure" in summary(message), summary(message)


def test_a_model_whose_weights_went_nan_is_not_exported_as_a_success():
    import keras
    import numpy as np

    from raytf.actor.loop import check_weights
    from raytf.errors import NonFiniteWeights

    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(2, name="dense_nan")])
    check_weights(parse(base_spec()), model, 2, 44, 0)  # finite: nothing to say
    kernel, bias = model.get_weights()
    kernel[0, 0] = np.nan
    model.set_weights([kernel, bias])
    with pytest.raises(NonFiniteWeights, match=r"hold NaN or inf after epoch 2, step 44 \(rank 0; \S*dense_nan/kernel\)"):
        check_weights(parse(base_spec()), model, 2, 44, 0)
    check_weights(parse(base_spec(train={"nonfinite_loss": "continue"})), model, 2, 44, 0)


def test_an_embedded_ray_whose_node_timed_out_at_its_start_is_started_once_more(monkeypatch):
    """Ray gives a raylet 30 s to register; on a machine with every core busy it once took longer. The embedded
    start is tried once more then, with what the first left shut down; any other failure is said at once."""
    import ray

    from raytf.driver import session
    from raytf.errors import RaytfError

    calls, shutdowns = [], []
    failures = [Exception("The current node timed out during startup. This could happen because ...")]
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))

    def init(address, **options):
        calls.append(address)
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(ray, "init", init)
    session._init_embedded({})
    assert calls == ["local", "local"] and shutdowns == [1]
    calls.clear()
    failures[:] = [Exception("The current node timed out during startup."), Exception("again")]
    with pytest.raises(RaytfError, match=r"could not connect to an embedded local Ray \(again\)"):
        session._init_embedded({})
    assert calls == ["local", "local"]
    failures[:] = [Exception("address already in use")]
    with pytest.raises(RaytfError, match="address already in use"):
        session._init_embedded({})
