"""Sweeps: the space, learning-rate scaling and concurrency as pure functions; then real Ray Tune sweeps
on the local multi-node cluster, every trial a 2-worker raytf job."""
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import raytf
from raytf import learning_rate, sweep, sweep_capacity, sweep_report
from raytf.cli import main
from raytf.driver.report import ProgressDisplay, Result
from raytf.errors import SpecError
from raytf.job import apply_overrides, load, parse
from tests.conftest import assert_nothing_left, base_spec, write_job

TUNE = {"metric": "val_loss", "mode": "min"}


def section(**fields):
    return sweep.parse_tune({**TUNE, **fields})


def points_of(tune_fields, **spec_sections):
    raw = base_spec(**spec_sections)
    base = parse(raw)
    return sweep.expand(section(**tune_fields), base, lambda pid, o: parse(apply_overrides(raw, o)))


# ---------------------------------------------------------------- pure


@pytest.mark.timeout(10)
def test_a_grid_expands_in_order_with_the_learning_rate_scaled_to_each_batch():
    points, rejected = points_of({"space": {"train.global_batch_size": {"grid": [64, 128]},
                                            "optimizer.learning_rate": {"grid": [0.01, 0.02]}},
                                  "lr_scaling": {"rule": "linear", "base_batch_size": 64}})
    assert [p.id for p in points] == ["p00", "p01", "p02", "p03"] and rejected == []
    assert [tuple(p.values.values()) for p in points] == [(64, 0.01), (64, 0.02), (128, 0.01), (128, 0.02)]
    assert [p.learning_rate for p in points] == [0.01, 0.02, 0.02, 0.04]  # linear: x2 at twice the batch
    assert all(p.overrides["train.global_batch_size"] == p.values["train.global_batch_size"] for p in points)


@pytest.mark.timeout(10)
def test_lr_scaling_rules():
    assert learning_rate.scaled(0.1, 256, "linear", 64) == pytest.approx(0.4)
    assert learning_rate.scaled(0.1, 256, "sqrt", 64) == pytest.approx(0.2)
    assert learning_rate.scaled(0.1, 32, "linear", 64) == pytest.approx(0.05)
    assert learning_rate.scaled(0.1, 256, "none", 64) == 0.1
    # base_batch_size defaults to the job's own global batch (64 in base_spec); lr from the job when not swept
    points, _ = points_of({"space": {"train.global_batch_size": {"grid": [256]}}, "lr_scaling": {"rule": "sqrt"}})
    assert points[0].learning_rate == pytest.approx(0.01 * 2)


@pytest.mark.timeout(10)
def test_lr_scaling_is_each_trials_own_scale_lr_and_not_both():
    points, _ = points_of({"space": {"train.accumulation_steps": {"grid": [1, 4]}},
                           "lr_scaling": {"rule": "linear", "base_batch_size": 64}})
    assert [p.overrides["optimizer.scale_lr"] for p in points] == [{"rule": "linear", "base_batch_size": 64}] * 2
    assert [p.learning_rate for p in points] == pytest.approx([0.01, 0.04])  # by the effective batch: 64, 256
    with pytest.raises(SpecError, match="tune.lr_scaling and optimizer.scale_lr both scale"):
        points_of({"space": {}, "lr_scaling": {"rule": "sqrt"}},
                  optimizer={"name": "adam", "learning_rate": 0.01, "scale_lr": {"rule": "linear", "base_batch_size": 8}})


@pytest.mark.timeout(10)
def test_random_draws_are_seeded_and_those_that_cannot_run_are_rejected_not_kept():
    fields = {"num_samples": 6, "seed": 3,
              "space": {"cluster.workers": {"choice": [2, 3]}, "optimizer.learning_rate": {"loguniform": [1e-4, 1e-2]}}}
    points, rejected = points_of(fields)  # global batch 64: 3 workers cannot split it
    assert len(points) == 6 and all(p.values["cluster.workers"] == 2 for p in points)
    assert rejected and all("not divisible by 3 replicas" in r["reason"] for r in rejected)
    assert all(1e-4 <= p.learning_rate <= 1e-2 for p in points)
    assert len({p.learning_rate for p in points}) == 6
    again, _ = points_of(fields)
    assert [p.values for p in again] == [p.values for p in points]  # same seed, same sweep (resume relies on it)
    assert [p.overrides["train.seed"] for p in points[1:]] == [1, 2, 3, 4, 5]  # repeats differ by seed
    assert "train.seed" not in points[0].overrides


@pytest.mark.timeout(10)
def test_a_grid_point_that_cannot_run_is_an_error_naming_the_point():
    with pytest.raises(SpecError) as info:
        points_of({"space": {"cluster.workers": {"grid": [2, 3]}}})
    msg = str(info.value)
    assert msg.startswith("point p01 {cluster.workers: 3} cannot run"), msg
    assert "global_batch_size 64 is not divisible by 3 replicas" in msg and "use 63 or 66" in msg
    with pytest.raises(SpecError, match="none of 50 random draws"):  # no draw of the random part can help
        points_of({"space": {"cluster.workers": {"grid": [3]}, "optimizer.learning_rate": {"uniform": [0.1, 0.2]}}})


SEARCH_SPACE = {"optimizer.learning_rate": {"loguniform": [0.001, 0.1]}, "train.global_batch_size": {"choice": [63, 64]}}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("tune_fields, expected", [
    ({"space": {"train.global_batch_size": [64, 128]}}, "tune.space.train.global_batch_size: [64, 128] is not a dimension; write {grid:"),
    ({"space": {"optimizer.learning_rate": {"loguniform": [0, 0.1]}}}, "bounds must be above 0"),
    ({"space": {"optimizer.learning_rate": {"uniform": [0.1]}}}, "uniform needs two numbers [low, high]"),
    ({"space": {"output.dir": {"grid": ["a", "b"]}}}, "tune.space.output.dir: set by the sweep for every trial"),
    ({"mode": "lowest"}, "tune.mode: 'lowest' is not one of 'min' or 'max'"),
    ({"max_concurrent_trials": 0}, "tune.max_concurrent_trials: 0 is not a trial count; use auto or a number >= 1"),
    ({"scheduler": {"name": "asha", "grace": 1}}, "tune.scheduler.grace: unknown key; known keys here: name, grace_period"),
    ({"search": {"algorithm": "ax"}}, "'ax' is not supported yet (never run with raytf's trials); use one of"),
    ({"search": {"algorithm": "bohb"}, "space": SEARCH_SPACE},
     "tune.search.algorithm: bohb suggests points for HyperBand's brackets and learns from their rungs; add "
     "scheduler: {name: hyperband}"),
    ({"search": {"algorithm": "tpe"}}, "'tpe' is not a search algorithm; use one of grid, random, optuna, hyperopt, bohb"),
    ({"search": {"algorithm": "optuna"}, "space": {"train.global_batch_size": {"grid": [32, 64]}}},
     "tune.space.train.global_batch_size: a grid is crossed up front; with search optuna write {choice: [32, 64]}"),
    ({"search": {"algorithm": "optuna", "points_to_evaluate": [{"optimizer.learning_rate": 0.5}]}, "space": SEARCH_SPACE},
     "tune.search.points_to_evaluate[0]: missing train.global_batch_size; give a value for each of"),
    ({"search": {"algorithm": "optuna", "points_to_evaluate": [{"optimizer.learning_rate": 0.5,
                                                                 "train.global_batch_size": 64}]}, "space": SEARCH_SPACE},
     "tune.search.points_to_evaluate[0]: optimizer.learning_rate: 0.5 is outside the space (loguniform: [0.001, 0.1])"),
    ({"search": {"algorithm": "grid", "points_to_evaluate": [{"optimizer.learning_rate": 0.01}]}},
     "tune.search.points_to_evaluate: tried first by a searcher (optuna, hyperopt, bohb); with grid, put the values"),
    ({"scheduler": {"name": "pbt", "grace_period": 2}, "space": SEARCH_SPACE},
     "tune.scheduler: grace_period is asha's, not pbt's; pbt takes perturbation_interval, quantile_fraction"),
    ({"scheduler": {"name": "pbt"}, "space": {"optimizer.learning_rate": {"grid": [0.1, 0.2]}}},
     "tune.space.optimizer.learning_rate: pbt draws its population at random; write {choice: [0.1, 0.2]}"),
    ({"scheduler": {"name": "pbt"}, "space": SEARCH_SPACE, "search": {"algorithm": "optuna"}},
     "pbt draws its population at random from the space and then perturbs it; drop tune.search"),
    ({"scheduler": {"name": "hyperband", "perturbation_interval": 2}},
     "perturbation_interval is pbt's, not hyperband's"),
    ({"scheduler": {"name": "hyperband"}, "space": {"cluster.workers": {"grid": [2, 4]}}},
     "tune.space.cluster.workers: hyperband stops and restarts trials at epochs of one schedule, in the placement "
     "group each trial started with; keep cluster.workers out of the space"),
])
def test_bad_tune_sections_name_the_key_and_the_fix(tune_fields, expected):
    with pytest.raises(SpecError) as info:
        sweep.parse_tune({**TUNE, **tune_fields}, "s.yaml")
    assert expected in str(info.value)


@pytest.mark.timeout(10)
def test_the_metric_must_be_one_the_job_reports():
    with pytest.raises(SpecError, match=r"'val_acc' is not reported by this job; it reports loss, accuracy, val_loss, val_accuracy"):
        sweep.check_metric(section(metric="val_acc"), parse(base_spec()), "s.yaml")


@pytest.mark.timeout(10)
def test_set_reaches_a_dimension_whose_key_has_dots():
    raw = {"tune": {**TUNE, "space": {}}, "train": {"epochs": 1}}
    out = sweep.apply_sweep_overrides(raw, {"tune.space.train.global_batch_size": {"grid": [32]}, "train.epochs": 2})
    assert out["tune"]["space"] == {"train.global_batch_size": {"grid": [32]}} and out["train"]["epochs"] == 2


# The test cluster: a 1-CPU head and two 1-CPU nodes with 2 GPUs each.
NODES = [{"CPU": 1.0, "memory": 1e9}, {"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 2.0}]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bundles, strategy, expected", [
    ([{"CPU": 0.5}] * 2, "PACK", 3),  # one trial per node
    ([{"CPU": 0.25}] * 2, "PACK", 6),
    ([{"CPU": 0.5, "GPU": 1}] * 2, "STRICT_SPREAD", 2),  # both GPU nodes, two trials
    ([{"CPU": 0.5, "GPU": 1}] * 2, "STRICT_PACK", 2),  # a node holds one whole trial
    ([{"CPU": 1}] * 2, "STRICT_PACK", 0),  # no node has 2 CPUs
    ([{"CPU": 1}] * 2, "PACK", 1),  # PACK may split a trial over nodes
    ([{"CPU": 0.5, "GPU": 3}], "PACK", 0),  # no node has 3 GPUs
])
def test_trials_that_fit_follow_the_placement_strategy(bundles, strategy, expected):
    assert sweep_capacity.trials_that_fit(NODES, bundles, strategy) == expected


@pytest.mark.timeout(10)
def test_auto_concurrency_sizes_for_the_largest_trial_and_the_number_of_trials():
    small, large = ([{"CPU": 0.5}] * 2, "PACK"), ([{"CPU": 0.5}] * 4, "PACK")
    assert sweep_capacity.auto_concurrency(NODES, [small], num_trials=10) == 3
    assert sweep_capacity.auto_concurrency(NODES, [small, large], num_trials=10) == 1  # 2 CPUs a trial: one at a time
    assert sweep_capacity.auto_concurrency(NODES, [small], num_trials=2) == 2
    assert sweep_capacity.auto_concurrency(NODES, [([{"CPU": 4}], "PACK")], num_trials=2) == 0


@pytest.mark.timeout(10)
def test_status_and_best_row():
    assert sweep_report.trial_status("TERMINATED", 3, 3) == "completed"
    assert sweep_report.trial_status("TERMINATED", 1, 3) == "stopped early"
    assert sweep_report.trial_status("ERROR", 1, 3) == "error"
    assert sweep_report.trial_status("PENDING", 0, 3) == "unfinished"
    rows = [{"point": "a", "status": "completed", "final": 0.5}, {"point": "b", "status": "stopped early", "final": 0.1},
            {"point": "c", "status": "completed", "final": 0.3}, {"point": "d", "status": "completed", "final": math.nan}]
    assert sweep_report.best_row(rows, "min")["point"] == "c"  # b has no final model: it stopped early
    assert sweep_report.best_row(rows, "max")["point"] == "a"
    assert sweep_report.best_of([0.3, math.nan, 0.1, 0.2], "min") == 0.1


@pytest.mark.timeout(10)
def test_the_table_shows_the_rate_raytfs_loop_ran_with_and_no_rate_column_for_a_train_fns_own():
    row = {"point": "p00", "status": "completed", "config": {"config.lr": 0.003}, "learning_rate": 0.01,
           "final": 0.25, "best": 0.2, "epochs": 3, "time_s": 12.0}
    header = sweep_report.table([row], "val_loss", ["config.lr"], row).splitlines()[0].split()
    assert header == ["point", "status", "lr", "lr", "final", "val_loss", "best", "val_loss", "epochs", "time", "(s)"]
    fn_row = {**row, "learning_rate": None}  # a train_fn's: the spec's optimizer rate is not what it ran with
    lines = sweep_report.table([fn_row], "val_loss", ["config.lr"], fn_row).splitlines()
    assert lines[0].split()[:3] == ["point", "status", "lr"] and lines[0].split()[3] == "final"
    assert lines[2].split()[3] == "0.003"  # the swept value, and no other rate beside it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["optuna", "hyperopt", "bohb"])
def test_a_searcher_tries_the_given_points_first_then_draws_inside_the_space(algorithm):
    from raytf import search

    first = {"optimizer.learning_rate": 0.003, "train.global_batch_size": 63}
    bohb = {"scheduler": {"name": "hyperband"}} if algorithm == "bohb" else {}  # BOHB's brackets
    s = section(space=SEARCH_SPACE, seed=3, search={"algorithm": algorithm, "points_to_evaluate": [first]}, **bohb)
    searcher = search.searcher(s)
    searcher.set_search_properties(s.metric, s.mode, search.param_space(s))
    suggested = [searcher.suggest(f"trial{i}") for i in range(6)]
    assert {k: suggested[0][k] for k in first} == first
    for config in suggested[1:]:
        assert 0.001 <= config["optimizer.learning_rate"] <= 0.1 and config["train.global_batch_size"] in (63, 64)
        plain = {k: sweep.plain(v) for k, v in config.items()}  # what a trial takes (BOHB suggests NumPy ints)
        assert type(plain["train.global_batch_size"]) is int and json.loads(json.dumps(plain)) == plain
    searcher.on_trial_complete("trial0", error=True)  # what Tune does with an unrunnable point's trial
    searcher.on_trial_complete("trial1", result={"val_loss": 0.5, **suggested[1]})
    assert search.point_id("1_optimizer.learning_rate=0.003", s) == "t00"  # a searcher's count starts at 1
    assert search.point_id("12_x=1", section(space=SEARCH_SPACE, num_samples=120, search={"algorithm": algorithm},
                                             **bohb)) == "t011"


@pytest.mark.timeout(60)
def test_a_suggested_point_that_cannot_run_says_why(job_dir):
    from raytf import tuner

    spec = base_spec(cluster={"workers": 2, "cpus_per_worker": 0.5})
    spec["tune"] = {**TUNE, "space": {**SEARCH_SPACE, "cluster.gpus_per_worker": {"choice": [0, 4]}},
                    "search": {"algorithm": "optuna"}, "num_samples": 5}
    plan = tuner.prepare(write_job(job_dir, spec, "sweep.yaml"))
    assert plan.points == [] and plan.num_trials == 5  # suggested as the sweep goes, not drawn now
    maker = tuner.Suggested(plan.base, plan.section, plan.source, NODES)
    good = maker.point("t00", {"optimizer.learning_rate": 0.01, "train.global_batch_size": 64, "cluster.gpus_per_worker": 0})
    job = maker.job(good, check_storage=False)
    assert job.spec.train.global_batch_size == 64 and job.output_where == str(job_dir / "runs" / "t" / "trials" / "t00")
    odd = maker.point("t01", {"optimizer.learning_rate": 0.01, "train.global_batch_size": 63, "cluster.gpus_per_worker": 0})
    with pytest.raises(tuner.UnrunnablePoint, match=r"point t01 \{.*\} cannot run: train.global_batch_size 63 is not "
                                                     r"divisible by 2 replicas"):
        maker.job(odd, check_storage=False)
    greedy = maker.point("t02", {"optimizer.learning_rate": 0.01, "train.global_batch_size": 64, "cluster.gpus_per_worker": 4})
    with pytest.raises(tuner.UnrunnablePoint, match=r"cannot run: it asks for 2 bundles of .*'GPU': 4.*the cluster has"):
        maker.job(greedy, check_storage=False)


@pytest.mark.timeout(30)
def test_each_scheduler_is_tunes_own_with_the_epoch_as_its_clock():
    from ray.tune.schedulers import ASHAScheduler, HyperBandForBOHB, HyperBandScheduler, PopulationBasedTraining

    from raytf import search

    asha = search.scheduler(section(scheduler={"name": "asha", "grace_period": 2}), max_t=4)
    assert isinstance(asha, ASHAScheduler)
    hyperband = search.scheduler(section(scheduler={"name": "hyperband", "reduction_factor": 3}), max_t=9)
    assert isinstance(hyperband, HyperBandScheduler) and hyperband._time_attr == "epoch" and hyperband._max_t_attr == 9
    bohb = search.scheduler(section(scheduler={"name": "hyperband"}, space=SEARCH_SPACE, search={"algorithm": "bohb"}),
                            max_t=4)
    assert type(bohb) is HyperBandForBOHB and bohb._time_attr == "epoch"  # the brackets BOHB learns from
    pbt_section = section(scheduler={"name": "pbt", "perturbation_interval": 2}, space=SEARCH_SPACE)
    pbt = search.scheduler(pbt_section, max_t=6)
    assert isinstance(pbt, PopulationBasedTraining) and pbt._synch and pbt._perturbation_interval == 2
    assert pbt._hyperparam_mutations["train.global_batch_size"] == [63, 64]
    assert search.search_algorithm(pbt_section).max_concurrent == 0  # the whole population at once
    assert search.creates_every_trial_at_once(pbt_section) and not search.creates_every_trial_at_once(section())
    assert search.how_many_at_once(section(), 3) == "up to 3 at once"
    assert search.how_many_at_once(pbt_section, 3) == "as many at once as the cluster holds"
    assert search.how_many_at_once(section(scheduler={"name": "hyperband"}, max_concurrent_trials=1), 1) == (
        "as many at once as the cluster holds (tune.max_concurrent_trials 1 does not apply under hyperband: Tune "
        "counts a paused trial against it)")
    assert search.within_bounds({"optimizer.learning_rate": (0.001, 0.1)}, {"optimizer.learning_rate": 0.12,
                                "train.global_batch_size": 64}) == {"optimizer.learning_rate": 0.1, "train.global_batch_size": 64}
    assert search.point_id("0_lr=0.1", pbt_section) == "t00" and search.point_id("1_lr=0.1", section(
        space=SEARCH_SPACE, search={"algorithm": "optuna"})) == "t00"  # a searcher's count starts at 1
    assert search.scheduler(section(), max_t=3) is None


@pytest.mark.timeout(60)
def test_pbt_refuses_a_choice_it_would_explore_into_that_cannot_run_and_a_train_fn_it_cannot_restart(job_dir):
    from raytf import tuner

    spec = base_spec()
    spec["tune"] = {**TUNE, "space": SEARCH_SPACE, "scheduler": {"name": "pbt"}, "num_samples": 2}
    with pytest.raises(SpecError, match=r"tune.space.train.global_batch_size: pbt explores every choice, and 63 "
                                        r"cannot run: train.global_batch_size 63 is not divisible by 2 replicas"):
        tuner.prepare(write_job(job_dir, spec, "sweep.yaml"))
    (job_dir / "own.py").write_text("def train(ctx):\n    pass\n")
    spec = {**base_spec(train_fn="own:train"), "tune": {**TUNE, "metric": "loss", "scheduler": {"name": "hyperband"},
                                                        "space": {"optimizer.learning_rate": {"grid": [0.1]}}}}
    spec.pop("model")
    with pytest.raises(SpecError, match="tune.scheduler hyperband starts trials again from the checkpoint raytf's "
                                        "loop writes at each epoch's end, which a train_fn's own loop does not"):
        tuner.prepare(write_job(job_dir, spec, "sweep.yaml"))
    spec["tune"]["scheduler"] = {"name": "asha"}
    spec["train"] = {"global_batch_size": 64}  # no train.epochs: the train_fn counts its own
    with pytest.raises(SpecError, match="tune.scheduler asha with a train_fn: the scheduler needs to know the last "
                                        "epoch, which your train_fn counts itself; set train.epochs"):
        tuner.prepare(write_job(job_dir, spec, "sweep.yaml"))


@pytest.mark.timeout(30)
def test_a_packed_checkpoint_becomes_the_only_one_and_says_where_it_came_from(tmp_path):
    from raytf import trial_checkpoint
    from raytf.checkpoint import Storage

    donor, taker = Storage(str(tmp_path / "donor")), Storage(str(tmp_path / "taker"))
    for storage, steps in ((donor, (22, 44)), (taker, (22, 44, 66))):
        for step in steps:
            files = tmp_path / f"files-{step}"
            files.mkdir(exist_ok=True)
            (files / "state.index").write_text(f"{storage.location} {step}")
            storage.upload(str(files), {"step": step, "epoch": step // 22 + 1, "step_in_epoch": 0, "history": []})
    assert trial_checkpoint.at_epoch_end(donor, 1, deadline_s=0).step == 22
    assert trial_checkpoint.at_epoch_end(donor, 3, deadline_s=0.3, poll_s=0.1) is None  # not saved: waits, then None
    folder = trial_checkpoint.pack(donor, trial_checkpoint.at_epoch_end(donor, 2, deadline_s=0), "t01", {"lr": 0.1})
    origin = trial_checkpoint.unpack(folder, taker)
    assert origin == {"point": "t01", "config": {"lr": 0.1}, "step": 44, "epoch": 2}
    (only,) = taker.list()
    assert only.step == 44 and only.epoch == 3  # the taker's own later ones are gone: it resumes from this
    assert open(os.path.join(only.path, "state.index")).read() == f"{donor.location} 44"
    trial_checkpoint.drop_before(donor, donor.latest())
    assert [c.step for c in donor.list()] == [44]
    # the taker's own checkpoint at the step handed back, cut short while it wrote raytf.json (a kill mid-save),
    # and a folder with no raytf.json: both go, and the handed-back one is the only one
    for step, broken in ((44, b'{"step": 4'), (88, None)):
        cut = tmp_path / "taker" / f"ckpt-{step:012d}"
        cut.mkdir(exist_ok=True)
        if broken is not None:
            (cut / "raytf.json").write_bytes(broken)
    folder = trial_checkpoint.pack(donor, donor.latest(), "t01", {"lr": 0.1})
    trial_checkpoint.unpack(folder, taker)
    (only,) = taker.list()
    assert only.step == 44 and open(os.path.join(only.path, "state.index")).read() == f"{donor.location} 44"
    assert sorted(os.listdir(tmp_path / "taker")) == ["ckpt-000000000044"]


@pytest.mark.timeout(10)
def test_trials_reuse_processes_by_default_but_not_under_a_scheduler_that_stops_or_pauses_them():
    from raytf.tuner import reuses_processes

    base = {"metric": "val_loss", "mode": "min", "space": {"optimizer.learning_rate": {"grid": [0.1, 0.2]}}}
    assert reuses_processes(sweep.TuneSection(**base))
    assert not reuses_processes(sweep.TuneSection(**base, reuse_processes=False))
    for scheduler in ({"name": "asha"}, {"name": "hyperband"}):
        assert not reuses_processes(sweep.TuneSection(**base, scheduler=scheduler))
    own = parse({**base_spec(train_fn="own:train"), "model": None})
    assert not reuses_processes(sweep.TuneSection(**base), own)  # a train_fn's collectives are its own
    assert reuses_processes(sweep.TuneSection(**base), parse(base_spec()))


@pytest.mark.timeout(10)
def test_the_search_path_keeps_the_best_so_far_in_trial_order():
    rows = [{"point": "t00", "status": "unrunnable", "final": None}, {"point": "t01", "status": "completed", "final": 0.5},
            {"point": "t02", "status": "completed", "final": 0.7}, {"point": "t03", "status": "stopped early", "final": 0.2}]
    path = sweep_report.search_path(rows, "min")
    assert [p["value"] for p in path] == [None, 0.5, 0.7, 0.2]
    assert [p["best_so_far"] for p in path] == [None, 0.5, 0.5, 0.2]
    assert [p["best_so_far"] for p in sweep_report.search_path(rows, "max")] == [None, 0.5, 0.7, 0.7]


# ---------------------------------------------------------------- the CLI, before any trial


@pytest.mark.timeout(60)
def test_an_invalid_grid_point_exits_2_before_any_trial_starts(job_dir):
    spec = base_spec(tune={**TUNE, "space": {"cluster.workers": {"grid": [2, 3]},
                                             "optimizer.learning_rate": {"grid": [0.01]}}})
    path = write_job(job_dir, spec, "sweep.yaml")
    result = CliRunner().invoke(main, ["tune", str(path)])
    assert result.exit_code == 2, result.output
    assert "point p01 {cluster.workers: 3, optimizer.learning_rate: 0.01} cannot run" in result.output
    assert "global_batch_size 64 is not divisible by 3 replicas" in result.output and "Traceback" not in result.output
    assert not (job_dir / "runs").exists()  # nothing started, nothing written


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tune_fields, sections, expected", [
    (None, {}, "no tune: section; a sweep file is a job spec plus tune:"),
    ({"metric": "val_acc"}, {}, "tune.metric: 'val_acc' is not reported by this job"),
    ({"scheduler": {"name": "asha", "grace_period": 3}}, {"train": {"epochs": 2}},
     "tune.scheduler.grace_period 3 is more than max_t 2 (epochs)"),
    ({"space": {"train.epochs": {"uniform": [1, 3]}}}, {}, "none of 50 random draws can run; the last: train.epochs"),
])
def test_a_bad_sweep_is_an_error_before_ray(job_dir, tune_fields, sections, expected):
    from raytf import tuner

    spec = base_spec(**sections)
    if tune_fields is not None:
        spec["tune"] = {**TUNE, **tune_fields}
    with pytest.raises(SpecError) as info:
        tuner.prepare(write_job(job_dir, spec, "sweep.yaml"))
    assert expected in str(info.value) and str(info.value).startswith(str(job_dir / "sweep.yaml"))


@pytest.mark.timeout(60)
def test_a_trial_no_set_of_nodes_can_hold_is_exit_3_at_once(job_dir):
    from raytf import tuner
    from raytf.errors import PlacementTimeout

    spec = base_spec(cluster={"workers": 2, "cpus_per_worker": 0.5, "gpus_per_worker": 3}, train={"global_batch_size": 60})
    spec["tune"] = {**TUNE, "space": {"optimizer.learning_rate": {"grid": [0.01, 0.02]}}}
    plan = tuner.prepare(write_job(job_dir, spec, "sweep.yaml"))
    assert tuner.concurrency(plan, [{"CPU": 8, "GPU": 8}]) == 1  # both trials need 12 of the 8 GPUs together
    with pytest.raises(PlacementTimeout, match=r"no trial fits this cluster: one asks for 2 bundles of .*'GPU': 3"):
        tuner.concurrency(plan, NODES)
    spec["tune"]["max_concurrent_trials"] = 2  # a number: trust it (an autoscaler may add the nodes)
    assert tuner.concurrency(tuner.prepare(write_job(job_dir, spec, "sweep.yaml")), NODES) == 2


# ---------------------------------------------------------------- real sweeps


def sweep_file(job_dir, tune_fields, **sections):
    spec = base_spec(**sections)
    spec["tune"] = {**TUNE, **tune_fields}
    return write_job(job_dir, spec, "sweep.yaml")


class ActorWatch:
    """Polls Ray's actor table: when each actor was last seen alive, its class and placement group."""

    def __init__(self, interval_s=0.5):
        self.seen, self.info, self.interval_s = {}, {}, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import ray
        from ray.util.state import list_actors

        address = ray.get_runtime_context().gcs_address  # this process's cluster, not the newest on the machine
        while not self._stop.is_set():
            now = time.time()
            for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=10_000):
                self.seen[a.actor_id] = now
                self.info[a.actor_id] = (a.class_name, a.placement_group_id)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def tune_progress(job_dir, point):
    """What Tune recorded of a trial: its reports in order (Tune's own progress.csv)."""
    import csv

    (folder,) = (job_dir / "runs" / "t" / "tune").glob(f"{point}_*")
    return list(csv.DictReader(open(folder / "progress.csv")))


# Which of p02 and p03 runs first decides whether p02 pauses at its rung: Tune's HyperBand pauses a trial there only
# while another live trial of its bracket has not reached it (`_Bracket.cur_iter_done`). Tune asks Ray for a
# placement group for every pending trial at once (up to TUNE_MAX_PENDING_TRIALS_PG, 200 and more), and which of
# them Ray places when one is freed is its GCS's retry order: p03 went before p02 in 2 of 8 runs (2026-12-07), and
# p02 then passed its rung unpaused. With one pending at a time, Tune requests them in its scheduler's order
# (`choose_trial_to_run`: p00, p01, p02, p03). A user's sweep runs the same trials; only their order may differ.
NOT_PAUSED = "p02 was not paused at its rung"


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_2x2_grid_under_hyperband_pauses_a_trial_for_another_promotes_it_and_reports_the_real_best(cluster, job_dir,
                                                                                                       monkeypatch):
    """A grid of learning rate {1e-6, 0.01} x global batch {48, 96}, every trial a 1-worker job; hyperband, max_t
    2, reduction factor 2: p00 and p01 (a useless rate) form a bracket that runs to the end; p02 (0.01, 48: 29 steps
    an epoch) and p03 (0.01, 96: 14) form a bracket whose rung is epoch 1. Three trials fit the cluster at once
    (max_concurrent_trials 1 does not apply under hyperband, and raytf says so): p02 pauses at epoch 1 (its
    placement group freed), p03 runs in its place and is stopped there (worse after its fewer steps), and p02 is
    promoted: it starts again from the checkpoint of its epoch 1 and trains epoch 2 only. Then what any sweep
    leaves: the real best as a job spec that runs, each trial's model and exports, sweep.json and sweep.png."""
    path = sweep_file(job_dir, {"space": {"optimizer.learning_rate": {"grid": [1e-6, 0.01]},
                                          "train.global_batch_size": {"grid": [48, 96]}},
                                "scheduler": {"name": "hyperband", "reduction_factor": 2}, "max_concurrent_trials": 1},
                      cluster={"workers": 1, "cpus_per_worker": 1}, train={"epochs": 2})
    monkeypatch.setenv("TUNE_MAX_PENDING_TRIALS_PG", "1")  # read by Tune's controller, in this process
    shown = io.StringIO()
    with ActorWatch() as watch:
        result = raytf.tune(path, display=ProgressDisplay(stream=shown))
        time.sleep(2)  # a last look at the actor table
    assert "tune.max_concurrent_trials 1 does not apply under hyperband" in shown.getvalue(), shown.getvalue()
    rows = {r["point"]: r for r in result.rows}
    assert [rows[p]["status"] for p in ("p00", "p01", "p02", "p03")] == \
        ["completed", "completed", "completed", "stopped early"], result.table

    promoted = rows["p02"]
    assert promoted["config"] == {"optimizer.learning_rate": 0.01, "train.global_batch_size": 48}
    restores = [(r["from"], r["after_epoch"], r["step"]) for r in promoted["restores"]]
    assert restores == [("p02", 1, 1437 // 48)], f"{NOT_PAUSED if not restores else 'restores'}: {restores}"
    saved = json.loads((job_dir / "runs" / "t" / "trials" / "p02" / "result.json").read_text())
    assert [h["epoch"] for h in saved["history"]] == [1, 2]  # every epoch once, the second after the restore
    assert [float(r["epoch"]) for r in tune_progress(job_dir, "p02")] == [1.0, 2.0]  # each reported once
    paused_at = float(tune_progress(job_dir, "p02")[0]["timestamp"])
    resumed_at = float(tune_progress(job_dir, "p02")[1]["timestamp"])
    ran_between = float(tune_progress(job_dir, "p03")[0]["timestamp"])
    assert paused_at <= ran_between <= resumed_at  # p03 ran in the CPUs p02's pause gave back

    finals = {p: r["final"] for p, r in rows.items() if r["status"] == "completed"}
    assert result.best["point"] == min(finals, key=finals.get) and result.best["final"] == min(finals.values())
    for point in finals:
        r = rows[point]
        saved = json.loads((job_dir / "runs" / "t" / "trials" / point / "result.json").read_text())
        batch = r["config"]["train.global_batch_size"]
        assert saved["status"] == "succeeded" and saved["workers"] == 1  # each trial: its own job
        assert [h["examples"] for h in saved["history"]] == [1437 // batch * batch] * 2  # ran with its own batch
        assert [h["val_loss"] for h in saved["history"]] == pytest.approx(r["history"])  # Tune saw every epoch
    assert result.best_spec_path == str(job_dir / "runs" / "t" / "best.yaml")  # in output.dir, not the job folder
    best_spec = load(result.best_spec_path)  # a ready-to-run job: the best point's values, no tune section
    assert best_spec.job_dir == job_dir  # its base_dir points back at the job folder: its code and data
    assert best_spec.output_dir == job_dir / "runs" / "t" / "best"
    assert best_spec.spec.train.global_batch_size == result.best["config"]["train.global_batch_size"]
    assert best_spec.spec.optimizer.learning_rate == result.best["config"]["optimizer.learning_rate"]
    assert "tune" not in yaml.safe_load(open(result.best_spec_path))
    best_dir = job_dir / "runs" / "t" / "trials" / result.best["point"]  # exported as a plain run would be
    assert result.best_model_path == str(best_dir / "model.keras") and os.path.getsize(result.best_model_path) > 0
    assert result.best_exports == {"keras": str(best_dir / "model.keras")}  # what output.export asked for (SavedModel export: test_serving)
    sweep_json = json.loads(open(result.sweep_json).read())
    assert len(sweep_json["rows"]) == 4 and sweep_json["best"]["point"] == result.best["point"]
    assert open(result.plot_path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert 0 < result.utilization <= 1
    assert result.table.count("\n") == 5 and "*  " + result.best["point"] in result.table

    # Every trial's result.json is a run's (the run lifecycle's keys, attempts included); the stopped one says
    # so and why, and `raytf results` is content with it; p02's pause is an attempt that ended stopped.
    trial_results = {p: json.loads((job_dir / "runs" / "t" / "trials" / p / "result.json").read_text())
                     for p in ("p00", "p01", "p02", "p03")}
    assert all(set(r) == set(Result.__dataclass_fields__) for r in trial_results.values())
    assert trial_results["p03"]["status"] == "stopped", trial_results["p03"]["error"]
    assert trial_results["p03"]["error"] == "paused or stopped by tune.scheduler hyperband after epoch 1"
    assert [a["ended_because"] for a in trial_results["p02"]["attempts"]] == \
        ["stopped: paused or stopped by tune.scheduler hyperband after epoch 1", "succeeded"]
    assert [a["resumed_from_step"] for a in trial_results["p02"]["attempts"]] == [None, 1437 // 48]
    said = subprocess.run([str(Path(sys.executable).parent / "raytf"), "results", "runs/t/trials/p03"], cwd=job_dir,
                          capture_output=True, text=True, timeout=60)
    assert said.returncode == 0 and said.stdout.startswith("t-p03: stopped (paused or stopped by"), said

    # The stopped trial's raytf actors ended with its Tune actor (they share its placement group), not later;
    # p02's group was given up at the pause: its workers ran in two groups.
    groups = {}
    for actor_id, (class_name, group) in watch.info.items():
        groups.setdefault(group, []).append((class_name, watch.seen[actor_id]))
    trials = [g for g, members in groups.items() if g and sum(c == "TaskActor" for c, _ in members) == 1]
    assert len(trials) == 5, groups  # p00, p01, p02 twice, p03
    stopped = max(trials, key=lambda g: min(t for _, t in groups[g]) if min(t for _, t in groups[g]) < resumed_at
                  else 0)  # the last trial to start before p02 came back: p03
    trial_actor_gone = max(t for c, t in groups[stopped] if c != "TaskActor")
    assert all(t - trial_actor_gone <= 2.0 for c, t in groups[stopped] if c == "TaskActor")
    assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_pbt_copies_a_better_trials_checkpoint_and_perturbs_rate_and_batch_with_no_epoch_trained_twice(cluster, job_dir):
    """Two trials, pbt every epoch: after epoch 1 the worse trial takes the better one's checkpoint of that epoch
    and goes on with its values perturbed (learning rate x0.8/x1.2, the batch a neighbouring choice), the rate
    scaled to the batch by lr_scaling. (ASHA, which only stops trials, is Tune's own and raytf's as before:
    test_each_scheduler_is_tunes_own...; hyperband's test shows a stopped trial's workers end with it.) One worker
    a trial: what is tested is the scheduler's; 2-worker trials are optuna's, the tf.keras sweep's and the user
    path's."""
    path = sweep_file(job_dir, {"space": {"optimizer.learning_rate": {"loguniform": [0.0003, 0.03]},
                                          "train.global_batch_size": {"choice": [32, 64, 128]}},
                                "scheduler": {"name": "pbt", "perturbation_interval": 1, "resample_probability": 0},
                                "lr_scaling": {"rule": "linear", "base_batch_size": 64},
                                "num_samples": 2, "seed": 4},
                      cluster={"workers": 1, "cpus_per_worker": 0.5}, train={"epochs": 2})
    result = raytf.tune(path)
    assert [r["status"] for r in result.rows] == ["completed", "completed"], result.table
    exploits = result.search["lineage"]
    assert exploits, result.search
    rows = {r["point"]: r for r in result.rows}
    batches = [32, 64, 128]
    for exploit in exploits:
        assert exploit["from"] != exploit["point"] and exploit["after_epoch"] == 1
        before, after = exploit["from_config"], exploit["config"]
        # explored from the donor's values: the rate x0.8 or x1.2 (kept inside the space's range), the batch the
        # same or a neighbouring choice
        scaled = [min(max(before["optimizer.learning_rate"] * f, 0.0003), 0.03) for f in (0.8, 1.2)]
        assert after["optimizer.learning_rate"] in [pytest.approx(v) for v in scaled], (before, after)
        assert abs(batches.index(after["train.global_batch_size"]) - batches.index(before["train.global_batch_size"])) <= 1
        # the donor's checkpoint of that epoch's end: its step is that many epochs of the donor's batch
        assert exploit["step"] == exploit["after_epoch"] * (1437 // before["train.global_batch_size"])
    for point, row in rows.items():
        saved = json.loads((job_dir / "runs" / "t" / "trials" / point / "result.json").read_text())
        assert [h["epoch"] for h in saved["history"]] == [1, 2]  # one path of epochs, each once
        assert [float(r["epoch"]) for r in tune_progress(job_dir, point)] == [1.0, 2.0]  # reported once each
        batch, lr = row["config"]["train.global_batch_size"], row["config"]["optimizer.learning_rate"]
        assert row["learning_rate"] == pytest.approx(lr * batch / 64)  # lr_scaling applied to the perturbed batch
        assert saved["history"][-1]["learning_rate"] == pytest.approx(lr * batch / 64, rel=1e-5)
    last = exploits[-1]
    taker = json.loads((job_dir / "runs" / "t" / "trials" / last["point"] / "result.json").read_text())
    donor_progress = tune_progress(job_dir, last["from"])
    # the taker's epochs up to the exploit are the donor's: its model went on from the donor's state
    assert [h["val_loss"] for h in taker["history"][:last["after_epoch"]]] == pytest.approx(
        [float(r["val_loss"]) for r in donor_progress[:last["after_epoch"]]])
    assert open(result.plot_path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_bohb_search_pauses_and_promotes_its_suggested_trials_with_every_epoch_trained_once(cluster, job_dir):
    """BOHB (Tune's TuneBOHB and HyperBandForBOHB) over learning rate (loguniform) x global batch (choice), every
    trial a 1-worker job (the searcher is what is tested), one at a time: the given point first, then BOHB's, inside
    the space. max_t 2, reduction factor 2: the first bracket's two trials pause at epoch 1 and the better one
    is promoted, resuming from its epoch-1 checkpoint; no trial trains or reports an epoch twice."""
    given = {"optimizer.learning_rate": 0.01, "train.global_batch_size": 48}
    path = sweep_file(job_dir, {"space": {"optimizer.learning_rate": {"loguniform": [0.0001, 0.03]},
                                          "train.global_batch_size": {"choice": [48, 96]}},
                                "search": {"algorithm": "bohb", "points_to_evaluate": [given]},
                                "scheduler": {"name": "hyperband", "reduction_factor": 2},
                                "num_samples": 2, "seed": 2, "max_concurrent_trials": 1},
                      cluster={"workers": 1, "cpus_per_worker": 1}, train={"epochs": 2})
    result = raytf.tune(path)
    rows = {r["point"]: r for r in result.rows}
    assert sorted(rows) == ["t00", "t01"] and rows["t00"]["config"] == given, result.table
    assert sorted(r["status"] for r in rows.values()) == ["completed", "stopped early"], result.table
    for row in rows.values():
        assert 0.0001 <= row["config"]["optimizer.learning_rate"] <= 0.03
        assert row["config"]["train.global_batch_size"] in (48, 96)
    promoted = [p for p, r in rows.items() if r["restores"]]
    assert promoted, result.table
    for point in promoted:
        batch = rows[point]["config"]["train.global_batch_size"]
        assert [(r["from"], r["after_epoch"], r["step"]) for r in rows[point]["restores"]] == [(point, 1, 1437 // batch)]
    for point, row in rows.items():
        if row["status"] == "completed":
            saved = json.loads((job_dir / "runs" / "t" / "trials" / point / "result.json").read_text())
            assert [h["epoch"] for h in saved["history"]] == [1, 2] and len({t["weights_digest"] for t in saved["tasks"]}) == 1
            assert [float(r["epoch"]) for r in tune_progress(job_dir, point)] == [1.0, 2.0]
    best = load(result.best_spec_path)
    assert best.spec.optimizer.learning_rate == result.best["config"]["optimizer.learning_rate"]
    assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_an_optuna_search_with_unrunnable_points_stops_and_resumes_the_same_search(cluster, job_dir, s3):
    """Optuna over learning rate (loguniform) x global batch (choice, 63 indivisible by 2 workers), its output.dir
    in a bucket: stopped as Ctrl-C would once t01 is done and a later trial runs, then resumed from storage (as on
    a new cluster). The searcher's state survives: no point is suggested twice, no finished trial runs again, the
    sweep ends with num_samples trials, the unrunnable ones recorded with the reason."""
    out = f"s3://{s3.bucket()}/sweeps/t"
    given = [{"optimizer.learning_rate": 0.01, "train.global_batch_size": 63},  # t00: cannot run
             {"optimizer.learning_rate": 0.01, "train.global_batch_size": 64},
             {"optimizer.learning_rate": 0.02, "train.global_batch_size": 64}]  # t02: runs when Ctrl-C comes
    path = sweep_file(job_dir, {"space": {"optimizer.learning_rate": {"loguniform": [0.003, 0.03]},
                                          "train.global_batch_size": {"choice": [63, 64]}},
                                "search": {"algorithm": "optuna", "points_to_evaluate": given},
                                "num_samples": 4, "max_concurrent_trials": 1, "seed": 1},
                      train={"epochs": 1}, output={"dir": out})
    first = f"{out}/trials/t01/result.json"

    def first_written() -> float | None:
        import pyarrow.fs as pafs

        info = s3.fs().get_file_info(first.removeprefix("s3://"))
        return info.mtime_ns if info.type == pafs.FileType.File else None

    def a_later_trial_runs() -> bool:  # its run wrote result.json "running" as it began
        return s3.fs().get_file_info(f"{out}/trials/t02/result.json".removeprefix("s3://")).size is not None

    def interrupt_after_t01():  # with one trial at a time, t02 running means t01 is done in Tune's state too
        deadline = time.time() + 200
        while time.time() < deadline:
            if first_written() is not None and a_later_trial_runs():
                os.kill(os.getpid(), signal.SIGINT)  # Tune catches it: saves its state (the searcher's too) and returns
                return
            time.sleep(0.5)

    threading.Thread(target=interrupt_after_t01, daemon=True).start()
    stopped = raytf.tune(path)
    assert stopped.interrupted and stopped.rows[0]["status"] == "unrunnable", stopped.table
    assert stopped.rows[1]["status"] == "completed" and stopped.rows[-1]["status"] == "unfinished", stopped.table
    written = first_written()
    assert_nothing_left()

    with pytest.raises(SpecError, match="already holds a sweep; pass --resume"):
        raytf.tune(path)
    resumed = raytf.tune(path, resume=True)
    assert not resumed.interrupted
    assert [r["point"] for r in resumed.rows] == ["t00", "t01", "t02", "t03"], resumed.table
    assert [r["trial_id"] for r in resumed.rows][:len(stopped.rows)] == [r["trial_id"] for r in stopped.rows]
    configs = [r["config"] for r in resumed.rows]
    assert configs[:3] == given  # the given points first, once: the searcher did not start over
    assert len({json.dumps(c, sort_keys=True) for c in configs}) == 4, configs
    for r in resumed.rows:
        if r["config"]["train.global_batch_size"] == 63:
            assert r["status"] == "unrunnable" and "63 is not divisible by 2 replicas" in r["error"], resumed.table
        else:
            assert r["status"] == "completed" and r["epochs"] == 1, resumed.table
    assert first_written() == written  # t01 was not run again
    saved = json.loads(s3.fs().open_input_file(f"{out}/sweep.json".removeprefix("s3://")).read())
    assert saved["search"]["algorithm"] == "optuna"
    assert [p["point"] for p in saved["search"]["path"]] == ["t00", "t01", "t02", "t03"]
    assert saved["search"]["path"][-1]["best_so_far"] == resumed.best["final"]
    assert {"sweep.json", "sweep.png", "best.yaml", "points.json", "trials/t01/result.json"} <= set(s3.files(out))
    assert not (job_dir / "runs").exists()
    assert_nothing_left()


LEGACY_TRAIN_FN = '''
import tensorflow as tf

EPOCHS = 3  # the script's own epoch count: train.epochs is left unset


def build_model():
    return tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(32, activation="relu"),
                                tf.keras.layers.Dense(10)])


def train(ctx):
    rate = ctx.spec.optimizer.learning_rate
    if rate > 0.1:
        raise ValueError(f"learning rate {rate} is too high for this script")
    with ctx.strategy.scope():
        model = ctx.build_model()
        model.compile(optimizer=tf.keras.optimizers.Adam(rate),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(ctx.distributed_dataset("train"), epochs=EPOCHS, steps_per_epoch=ctx.steps_per_epoch, verbose=0,
              callbacks=[tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: ctx.report(logs)),
                         tf.keras.callbacks.TensorBoard(log_dir="./logs"),  # as the tutorials write them
                         tf.keras.callbacks.ModelCheckpoint("best.keras", monitor="loss", save_best_only=True)])
    ctx.save_model(model)  # on every worker, as tf-keras needs
'''


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_a_sweep_of_a_tf_keras_train_fn_saves_every_trial_hears_its_epochs_in_order_and_fails_for_a_failed_trial(
        job_dir):
    """Two trials of a tf.keras train_fn that counts its own 3 epochs and saves on every worker (tf-keras's
    save is a collective): its processes are not reused (a reused group hung in that save), the good trial is
    exported with what the script's own TensorBoard and ModelCheckpoint callbacks wrote (outputs/) and raytf's
    epoch events, Tune hears epochs 1, 2, 3 in that order (not 2, 3, 1: the spec's train.epochs is 1), and the
    trial that raises makes `raytf tune` exit 1 with one line naming it, without Tune's traceback. The console
    script from the job folder, on its embedded local Ray."""
    import subprocess
    import sys
    from pathlib import Path

    (job_dir / "legacy_fn.py").write_text(LEGACY_TRAIN_FN)
    spec = base_spec(model="legacy_fn:build_model", train_fn="legacy_fn:train",
                     cluster={"workers": 2, "cpus_per_worker": 0.5})
    spec["train"] = {"global_batch_size": 64, "seed": 0, "keras": "legacy"}
    spec["tune"] = {"metric": "loss", "mode": "min", "space": {"optimizer.learning_rate": {"grid": [0.01, 0.5]}}}
    path = write_job(job_dir, spec, "sweep.yaml")
    alone = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded Ray, as a user's
    proc = subprocess.run([str(Path(sys.executable).parent / "raytf"), "tune", path.name], capture_output=True,
                          text=True, timeout=380, cwd=job_dir, env=alone)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "each trial starts new processes: a train_fn's own collectives" in proc.stderr
    failed = [line for line in proc.stderr.splitlines() if line.startswith("raytf: error: trial ")]
    assert len(failed) == 1 and failed[0].startswith("raytf: error: trial p01 failed: ") and "too high" in failed[0], \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "tune_controller" not in proc.stderr
    for point in ("p00",):
        told = [int(row["epoch"]) for row in tune_progress(job_dir, point)]
        assert told == [1, 2, 3], (point, told)
        said = [line for line in proc.stderr.splitlines() if line.startswith(f"raytf: {point} epoch ")]
        assert [line.split()[3] for line in said] == ["1/?:", "2/?:", "3/?:"], said
        result = json.loads((job_dir / "runs" / "t" / "trials" / point / "result.json").read_text())
        assert result["status"] == "succeeded" and len(result["history"]) == 3
        trial = job_dir / "runs" / "t" / "trials" / point
        assert (trial / "model.keras").is_file()
        # what the script's own callbacks wrote on the chief came home; raytf's epoch events too
        assert (trial / "outputs" / "best.keras").is_file() and list((trial / "outputs" / "logs").rglob("events.out*"))
        assert list((trial / "tensorboard").glob("events.out*"))
    rows = {r["point"]: r for r in json.loads((job_dir / "runs" / "t" / "sweep.json").read_text())["rows"]}
    assert [rows[p]["status"] for p in ("p00", "p01")] == ["completed", "error"] and rows["p00"]["epochs"] == 3
    assert rows["p00"]["learning_rate"] is None  # the train_fn's own optimizer: the spec's rate is not shown
