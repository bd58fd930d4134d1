"""Bring your own loop: a train_fn gets this worker's shard of the job's data, checkpoints that a restart
and --resume restore, and progress for the watchdog; an existing tf.keras script's model.fit runs under
train.keras: legacy; a Keras 3 model.fit in a train_fn is refused before anything starts.

The shipped examples (jobs/digits-custom.yaml, jobs/digits-legacy.yaml) run from a copy of the job folder,
the first as users run it: the console script from inside that folder."""
import importlib.util
import json
import shutil
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raytf
from raytf.driver.controller import run
from raytf.errors import SpecError
from raytf.job import load
from raytf.job_code import fit_calls
from tests.conftest import DIGITS, REPO, assert_nothing_left, base_spec, write_job
from tests.faults import Killer
from tests.test_user_paths import files_under, run_cli, run_on_cluster

EPOCHS = 3
STEPS_PER_EPOCH = 1437 // 64  # digits, global batch 64: 22 steps per epoch


@pytest.fixture(scope="module")
def jobs_copy(tmp_path_factory):
    """A user's copy of jobs/ (the two own-loop examples, their code and the digits data); results land in
    ../runs/<name> next to it, as the job files say."""
    jobs = tmp_path_factory.mktemp("own") / "jobs"
    (jobs / "data").mkdir(parents=True)
    for name in ("digits-custom.yaml", "digits_custom.py", "digits-legacy.yaml", "digits_legacy.py"):
        shutil.copy2(REPO / "jobs" / name, jobs / name)
    for name in ("digits-train.parquet", "digits-test.parquet"):
        shutil.copy2(DIGITS / name, jobs / "data" / name)
    return jobs


@pytest.fixture(scope="module")
def custom_run(cluster, jobs_copy):
    """jobs/digits-custom.yaml, uninterrupted, through the console script from inside the job folder, with
    `--address` to the session's cluster."""
    before = files_under(jobs_copy)
    proc = run_on_cluster(["run", "digits-custom.yaml", "--set", f"train.epochs={EPOCHS}", "--set",
                           "failure.standby=false"], jobs_copy, cluster, timeout=280)  # no warm standbys: nothing is killed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert files_under(jobs_copy) == before  # nothing new in the job folder
    out = jobs_copy.parent / "runs" / "digits-custom"
    return json.loads((out / "result.json").read_text()), out


# ---------------------------------------------------------------- before anything starts (no cluster)

@pytest.mark.timeout(30)
def test_fit_calls_are_found_in_the_train_fn_and_the_functions_it_calls():
    source = textwrap.dedent('''
        def helper(model):
            model.fit(x)

        def train(ctx):
            model = build()
            history = model.fit(ds, epochs=3)
            return history

        def train_func(config):  # Ray Train's shape, wrapped
            model.fit(ds)

        def wrapper(ctx):
            return train_func({"lr": 0.1})
    ''')
    assert fit_calls(source, "train") == [7]
    assert fit_calls(source, "helper") == [3]
    assert fit_calls(source, "wrapper") == [11]
    assert fit_calls(source, "missing") == []


@pytest.mark.timeout(30)
def test_a_keras3_fit_is_refused_before_any_actor_and_legacy_needs_tf_keras(job_dir, monkeypatch):
    (job_dir / "script.py").write_text("def train(ctx):\n    model = ctx.build_model()\n    model.fit(ctx.dataset())\n")
    spec = base_spec(train_fn="script:train")
    with pytest.raises(SpecError, match=r"calls \.fit\(\) \(line 3\).*train\.keras: legacy"):
        load(write_job(job_dir, spec), check_code=False)
    spec["train"]["keras"] = "keras3"  # said explicitly: not checked
    load(write_job(job_dir, spec), check_code=False)
    spec["train"]["keras"] = "legacy"
    load(write_job(job_dir, spec), check_code=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tf_keras" else real(name, *a))
    with pytest.raises(SpecError, match=r"train.keras: legacy needs tf-keras .*pip install 'raytf\[legacy\]'"):
        load(write_job(job_dir, spec), check_code=False)
    with pytest.raises(SpecError, match="raytf's own loop .* is Keras 3"):
        load(write_job(job_dir, base_spec(train={"keras": "legacy"})), check_code=False)


@pytest.mark.timeout(60)
def test_a_keras3_fit_script_exits_2_in_one_line_without_tensorflow(jobs_copy):
    proc = run_cli(["run", "digits-legacy.yaml", "--set", "train.keras=null"], cwd=jobs_copy, timeout=50)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "digits_legacy:train calls .fit() (line" in lines[0], lines


# ---------------------------------------------------------------- on the cluster

@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_custom_loop_example_trains_with_identical_workers(custom_run):
    result, out = custom_run
    assert result["status"] == "succeeded" and len(result["history"]) == EPOCHS
    losses = [h["loss"] for h in result["history"]]
    assert losses == sorted(losses, reverse=True), losses
    assert result["history"][-1]["val_accuracy"] >= 0.9, result["history"][-1]
    assert len({t["weights_digest"] for t in result["tasks"]}) == 1  # BatchNormalization + Dropout model
    assert [t["steps"] for t in result["tasks"]] == [EPOCHS * STEPS_PER_EPOCH] * 2
    assert (out / "model.keras").is_file()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == [f"ckpt-{60:012d}", f"ckpt-{66:012d}"]  # every 10 steps and each epoch's end, keep 2
    assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_killed_worker_resumes_the_custom_loop_from_its_checkpoint(cluster, jobs_copy, custom_run, tmp_path):
    uninterrupted, _ = custom_run
    killer = Killer(rank=1, at_step=31, attempts={1})  # after the checkpoint at step 30
    job = load(jobs_copy / "digits-custom.yaml", {"train.epochs": EPOCHS, "output.dir": str(tmp_path / "out"),
                                                  "checkpoint.dir": str(tmp_path / "ckpt")})
    result = run(job, group_cls=killer.group_cls)
    assert killer.killed_at, "the worker was never killed"
    assert len(result.restarts) == 1 and result.restarts[0]["kind"] == "actor_died"
    assert result.restarts[0]["resumed_from_step"] in (30, 40)  # the latest checkpoint before the kill
    assert [t["steps"] for t in result.tasks] == [EPOCHS * STEPS_PER_EPOCH] * 2
    assert len({t["weights_digest"] for t in result.tasks}) == 1
    assert [h["epoch"] for h in result.history] == list(range(1, EPOCHS + 1))  # epoch 1 came back from the checkpoint
    final, expected = result.history[-1]["loss"], uninterrupted["history"][-1]["loss"]
    assert abs(final - expected) <= 0.15 * expected + 0.02, (final, expected)
    assert result.history[-1]["val_accuracy"] >= 0.9
    assert_nothing_left()


ROWS_ONCE = textwrap.dedent('''
    import json
    import numpy as np

    def train(ctx):
        """Every id this worker reads: two epochs of train (padded rows have weight 0) and one validation pass."""
        seen = {}
        for epoch in (1, 2):
            ids = []
            for x, y, w in ctx.dataset("train", epoch=epoch):
                ids += [int(i) for i, keep in zip(x.numpy(), w.numpy()) if keep > 0]
            seen[f"train-{epoch}"] = ids
        seen["validation"] = [int(i) for x, y, w in ctx.dataset("validation")
                              for i, keep in zip(x.numpy(), w.numpy()) if keep > 0]
        seen["steps_per_epoch"] = ctx.steps_per_epoch
        seen["ctx"] = [ctx.rank, ctx.world_size, ctx.num_replicas, ctx.per_replica_batch_size, ctx.is_chief]
        seen["resumed"] = [int(x.numpy()[0]) for x, y, w in ctx.dataset("train", epoch=2, skip=1).take(1)]
        with open(f"{OUT}/rank-{ctx.rank}.json", "w") as f:
            json.dump(seen, f)
        ctx.report({"loss": 0.0})
''')


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_ctx_dataset_gives_each_row_to_one_worker_once_per_epoch(cluster, job_dir, tmp_path):
    ids = np.arange(203, dtype=np.int64)  # 203 = 3 row groups of 80, 80, 43: uneven shards, a padded last batch
    pq.write_table(pa.table({"id": ids, "label": ids % 3}), job_dir / "ids.parquet", row_group_size=80)
    pq.write_table(pa.table({"id": ids[:51] + 1000, "label": ids[:51] % 3}), job_dir / "ids-val.parquet")
    (job_dir / "rows.py").write_text(f"OUT = {str(tmp_path)!r}\n" + ROWS_ONCE)
    spec = base_spec(model=None, train_fn="rows:train", train={"global_batch_size": 16},
                     data={"train": "ids.parquet", "validation": "ids-val.parquet", "features": ["id"],
                           "label": "label", "remainder": "pad"})
    raytf.fit(write_job(job_dir, spec))
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for epoch in (1, 2):
        got = seen[0][f"train-{epoch}"] + seen[1][f"train-{epoch}"]
        assert sorted(got) == list(range(203)), f"epoch {epoch}: each row once"
        assert not set(seen[0][f"train-{epoch}"]) & set(seen[1][f"train-{epoch}"])
    assert seen[0]["train-1"] != seen[0]["train-2"]  # reshuffled each epoch
    assert sorted(seen[0]["validation"] + seen[1]["validation"]) == list(range(1000, 1051))
    assert seen[0]["steps_per_epoch"] == seen[1]["steps_per_epoch"] == 13  # ceil(102 rows / 8 per worker)
    assert [s["ctx"] for s in seen] == [[0, 2, 2, 8, True], [1, 2, 2, 8, False]]
    # skip=1: the batch after epoch 2's first, as a resumed loop reads it
    assert seen[0]["resumed"] == [seen[0]["train-2"][8]]
    assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_tf_keras_fit_script_trains_on_two_workers_under_legacy(cluster, jobs_copy, tmp_path):
    result = raytf.fit(jobs_copy / "digits-legacy.yaml", {"train.epochs": EPOCHS, "output.dir": str(tmp_path)})
    losses = [h["loss"] for h in result.history]
    assert len(losses) == EPOCHS and losses == sorted(losses, reverse=True), losses
    assert result.history[-1]["accuracy"] >= 0.8
    assert len({t["weights_digest"] for t in result.tasks}) == 1
    assert (tmp_path / "model.keras").is_file()
    # model.fit says no step: each task's count is its optimizer's (1,437 rows / 64 per step, each epoch)
    assert [t["steps"] for t in result.tasks] == [EPOCHS * (1437 // 64)] * 2, result.tasks
    assert_nothing_left()
