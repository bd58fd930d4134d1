"""The run lifecycle (raytf.driver.run) that `raytf run`, `raytf.fit`, a submitted job and each sweep trial share:
what it reads before the first step, what it leaves in result.json whatever ends the run. Ray and the controller
are stood in for at their seams (the controller has its own stepped tests; real runs are the cluster tests)."""
import contextlib
import json

import pytest

import raytf
from raytf import checkpoint, job
from raytf.driver import controller, run, session
from raytf.driver.callbacks import TrialStopped
from raytf.driver.report import ProgressDisplay, Result
from tests.conftest import base_spec, write_job
from tests.fakes import NO_CODE


class StandInController:
    """controller.start's seam: records what the lifecycle hands the controller, ends as told."""

    def __init__(self, job, ends=None, **options):
        self.job, self.options, self.ends = job, options, ends
        self.result = Result(name=job.spec.name, strategy=job.spec.strategy, status="failed",
                             output_dir=job.output_where, attempts=options["attempts"])

    def run(self):
        if self.ends is not None:
            self.result.status, self.result.error = ("stopped", self.ends.reason) if isinstance(
                self.ends, TrialStopped) else ("failed", str(self.ends))
            self.result.write(self.job.output_dir)
            raise self.ends
        self.result.status = "succeeded"
        self.result.write(self.job.output_dir)
        return self.result


class Stage:
    """What controller.start was given (`started`), and how the next run ends (`ends`: None for success)."""

    def __init__(self):
        self.started, self.ends = [], None


@pytest.fixture
def no_ray(monkeypatch):
    """Ray's session and the controller stood in for."""
    stage = Stage()
    monkeypatch.setattr(session, "ray_session", lambda address=None, verbose=False: contextlib.nullcontext())
    monkeypatch.setattr(session, "cluster_identity", lambda: {"session": "s", "address": "a"})

    def start(job, **options):
        stage.started.append(StandInController(job, stage.ends, **options))
        return stage.started[-1]

    monkeypatch.setattr(controller, "start", start)
    return stage


def _checkpoint_at(folder, step):
    ckpt = folder / f"ckpt-{step:012d}"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.META).write_text(json.dumps({"step": step, "epoch": 2, "step_in_epoch": 0,
                                                    "history": [{"epoch": 1, "loss": 1.0}]}))


def test_a_resumed_run_reads_its_job_file_once_and_lists_its_checkpoints_once_before_the_first_step(
        job_dir, no_ray, monkeypatch):
    _checkpoint_at(job_dir / "ckpts", 40)
    path = write_job(job_dir, base_spec(checkpoint={"dir": "ckpts"}, resume=True))
    reads, listings = [], []
    read_yaml, list_checkpoints = job.read_yaml, checkpoint.Storage.list
    monkeypatch.setattr(job, "read_yaml", lambda p: reads.append(p) or read_yaml(p))
    monkeypatch.setattr(checkpoint.Storage, "list", lambda self: listings.append(self.location) or
                        list_checkpoints(self))
    result = raytf.fit(str(path))
    assert result.status == "succeeded"
    assert len(reads) == 1, reads
    assert len(listings) == 1, listings
    given = no_ray.started[0].options
    assert given["first_checkpoint"].step == 40 and given["resume"] is True
    assert given["attempts"][0]["resumed_from_step"] == 40


def test_a_stopped_trial_is_stopped_in_result_json_with_the_reason_and_its_attempt_closed(job_dir, no_ray):
    loaded = job.load(write_job(job_dir, base_spec()), check_code=False)
    stop = no_ray.ends = TrialStopped("stopped early by tune.scheduler asha after epoch 1")
    with pytest.raises(SystemExit):  # what Tune expects from a trial it stopped
        run.execute(loaded, resume=False, display=ProgressDisplay(quiet=True), code=NO_CODE)
    written = json.loads((loaded.output_dir / "result.json").read_text())
    assert written["status"] == "stopped" and written["error"] == stop.reason
    from raytf import results

    assert results.exit_code(written) == 0


def test_a_trial_result_json_has_the_keys_of_a_run_result_json(job_dir, no_ray):
    """Both are raytf.driver.report.Result, written through the same lifecycle: the same top-level keys."""
    loaded = job.load(write_job(job_dir, base_spec()), check_code=False)
    run.execute(loaded, resume=False, display=ProgressDisplay(quiet=True), code=NO_CODE)
    written = json.loads((loaded.output_dir / "result.json").read_text())
    assert set(written) == {f for f in Result.__dataclass_fields__}
    assert [a["attempt"] for a in written["attempts"]] == [1] and written["attempts"][0]["started"]


def test_the_result_json_page_describes_every_key_result_json_has():
    from tests.conftest import REPO

    page = (REPO / "docs" / "reference" / "result-json.md").read_text()
    missing = [key for key in Result.__dataclass_fields__ if f"`{key}`" not in page]
    assert missing == [], f"docs/reference/result-json.md does not describe {missing}"


def test_a_trial_whose_process_died_leaving_running_is_closed_by_the_sweep_with_tunes_reason(job_dir):
    """A trial actor killed mid-epoch never closes its result.json; the sweep's driver does once Tune is done
    with the trial (raytf.sweep_results), so nothing is left "running" and its attempt says why it ended."""
    from raytf.driver import attempts
    from raytf.sweep_results import _close_lost

    class KilledTrial:  # what Tune's record of such a trial answers
        status = "ERROR"

        def get_error(self):
            return "Traceback ...\nray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."

    loaded = job.load(write_job(job_dir, base_spec()), check_code=False)
    running = Result(name="t", strategy="mirrored", status="running", output_dir=loaded.output_where,
                     attempts=[attempts.begin(1, {"session": "s", "address": "a"}, None)])
    running.write(loaded.output_dir)
    closed = _close_lost(loaded, running.to_dict(), KilledTrial())
    written = json.loads((loaded.output_dir / "result.json").read_text())
    assert written == json.loads(json.dumps(closed))
    assert written["status"] == "failed" and "ActorDiedError: The actor died unexpectedly" in written["error"]
    assert written["attempts"][0]["ended"] and written["attempts"][0]["ended_because"].startswith("failed: the trial's")
