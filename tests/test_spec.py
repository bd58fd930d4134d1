"""Bad specs are one clear error naming the key, the value and the fix, exit code 2, before any actor."""
import pytest
from click.testing import CliRunner

from raytf.cli import main
from raytf.errors import SpecError
from raytf.job import apply_overrides, load, parse, parse_set_options
from tests.conftest import base_spec, write_job


def error_of(raw):
    with pytest.raises(SpecError) as info:
        parse(raw)
    return str(info.value)


def test_a_valid_spec_gets_defaults():
    spec = parse(base_spec())
    assert spec.cluster.placement == "pack" and spec.loss.from_logits is True
    assert spec.train.steps_per_epoch is None and spec.strategy == "mirrored"


def test_unknown_keys_are_errors_that_list_the_known_ones():
    msg = error_of(base_spec(cluster={"wrkers": 2}))
    assert "cluster.wrkers: unknown key" in msg and "workers" in msg and "reserve_timeout_s" in msg


def test_wrong_types_name_the_key_and_the_value():
    msg = error_of(base_spec(train={"epochs": "many"}))
    assert "train.epochs" in msg and "'many'" in msg


def test_indivisible_global_batch_names_the_nearest_valid_values():
    msg = error_of(base_spec(train={"global_batch_size": 100}, cluster={"workers": 3}))
    assert "global_batch_size 100 is not divisible by 3 replicas" in msg and "use 99 or 102" in msg
    msg = error_of(base_spec(train={"global_batch_size": 2}, cluster={"workers": 3}))
    assert "use 3" in msg


def test_gpus_per_worker_count_as_replicas():
    msg = error_of(base_spec(train={"global_batch_size": 64}, cluster={"workers": 3, "gpus_per_worker": 2}))
    assert "6 replicas (3 workers x 2)" in msg


def test_bad_placement_and_function_names():
    assert "'diagonal' is not one of" in error_of(base_spec(cluster={"placement": "diagonal"}))
    assert "is not a module:function name" in error_of(base_spec(model="tmodel.build_model"))


def test_dataset_fn_needs_steps_per_epoch_and_excludes_data():
    spec = base_spec(dataset_fn="tmodel:make")
    assert "exactly one of data" in error_of(spec)
    spec.pop("data")
    assert "train.steps_per_epoch: required with dataset_fn" in error_of(spec)


def test_data_options_are_checked():
    assert "['nope'] are not among data.features" in error_of(base_spec(data={"fill_nulls": {"nope": 0}}))
    assert "remainder: pad reads every row" in error_of(base_spec(data={"remainder": "pad"},
                                                                  train={"steps_per_epoch": 3}))
    assert "'keep' is not one of" in error_of(base_spec(data={"remainder": "keep"}))


def ps(**sections):
    return base_spec(strategy="parameter_server", **{"cluster": {"ps": 1}, **sections})


def test_parameter_server_specs_are_checked():
    assert parse(ps()).cluster.ps == 1
    assert "cluster.ps: 0 under strategy parameter_server" in error_of(ps(cluster={"ps": 0}))
    assert "cluster.ps: 0 under strategy parameter_server" in error_of(base_spec(strategy="parameter_server"))
    # ps keys under mirrored name the key and both ways out
    for key, value in [("ps", 1), ("cpus_per_ps", 2), ("evaluator", True), ("variable_partitioner", {"shards": 2, "kind": "fixed"})]:
        message = error_of(base_spec(cluster={key: value}))
        assert f"cluster.{key} is for strategy: parameter_server; remove it" in message, message
    assert "kind fixed needs shards" in error_of(ps(cluster={"ps": 1, "variable_partitioner": {"kind": "fixed"}}))
    assert "the evaluator evaluates the chief's checkpoints" in error_of(ps(cluster={"ps": 1, "evaluator": True}))
    assert parse(ps(train={"precision": "mixed_float16"}))  # one loop: both strategies
    assert "XLA cannot compile a step whose variables live on the ps tasks" in error_of(ps(train={"jit_compile": True}))
    assert "ClusterCoordinator sends each step to whichever worker is free" in error_of(ps(data={"remainder": "pad"}))
    assert "failure.elastic is not supported" in error_of(ps(failure={"elastic": {"min_workers": 1}}))
    # the strategy's refusals come before the general rules a refused key would also break
    assert "failure.elastic is not supported" in error_of(ps(failure={"elastic": {"min_workers": 5}}))
    assert "cluster.gpu_placement: per_node is not supported" in error_of(
        ps(cluster={"ps": 1, "gpu_placement": "per_node", "gpus_per_worker": 2}))
    # Tune: an evaluator's val_* come after the epochs, so a sweep cannot rank trials by them
    from raytf.sweep import reported_metrics

    with_evaluator = parse(ps(cluster={"ps": 1, "evaluator": True}, checkpoint={"dir": "ckpt"}))
    assert reported_metrics(with_evaluator) == ["loss", "accuracy"]
    assert reported_metrics(parse(ps())) == ["loss", "accuracy", "val_loss", "val_accuracy"]
    # one step's batch runs on one worker: it must divide by that worker's GPUs, not by all of them
    assert parse(ps(cluster={"ps": 1, "workers": 3, "gpus_per_worker": 2}, train={"global_batch_size": 64}))
    assert "divisible by the 2 GPUs of a worker; use 62 or 64" in error_of(
        ps(cluster={"ps": 1, "gpus_per_worker": 2}, train={"global_batch_size": 63}))


def test_parameter_servers_take_a_train_fn_a_dataset_fn_and_tf_keras():
    own = {"model": None, "data": None, "train_fn": "tmodel:train"}
    assert parse(ps(**own)).train_fn == "tmodel:train"  # on the chief, with ctx.strategy and ctx.coordinator
    assert parse(ps(train_fn="tmodel:train")).data is not None  # ... reading the job's data through ctx.dataset
    assert parse(ps(**own, train={"keras": "legacy"})).train.keras == "legacy"  # tf.keras, model.fit included
    spec = parse(ps(data=None, dataset_fn="tmodel:ds", train={"steps_per_epoch": 5}))  # raytf's loop over it
    assert spec.dataset_fn == "tmodel:ds" and spec.train.steps_per_epoch == 5
    # what stays refused says why and what to do
    assert "train.steps_per_epoch: required with dataset_fn" in error_of(ps(data=None, dataset_fn="tmodel:ds"))
    assert "train.keras: legacy runs a train_fn" in error_of(ps(train={"keras": "legacy"}))
    message = error_of(ps(**own, cluster={"ps": 1, "evaluator": True}, checkpoint={"dir": "ckpt"}))
    assert "cluster.evaluator evaluates the checkpoints of raytf's loop, not a train_fn's" in message
    assert "ctx.dataset('validation')" in message and "evaluator: false" in message
    assert "XLA cannot compile" in error_of(ps(**own, train={"jit_compile": True}))
    assert "optimizer.scale_lr is for raytf's loop" in error_of(
        ps(**own, optimizer={"scale_lr": {"rule": "linear", "base_batch_size": 32}}))


def test_a_keras3_fit_in_a_parameter_server_train_fn_is_refused_with_the_way_out(job_dir):
    (job_dir / "fits.py").write_text("def train(ctx):\n    model = ctx.build_model()\n    model.fit(ctx.dataset())\n")
    raw = ps(train_fn="fits:train")
    with pytest.raises(SpecError) as info:
        load(write_job(job_dir, raw), check_data=False, check_code=False)
    message = str(info.value)
    assert "calls .fit() (line 3)" in message and "does not drive ParameterServerStrategy's ClusterCoordinator" in message
    assert "train.keras: legacy" in message and "ctx.coordinator.schedule" in message
    legacy = load(write_job(job_dir, ps(train_fn="fits:train", train={"keras": "legacy"})), check_data=False,
                  check_code=False)
    assert legacy.spec.train.keras == "legacy"  # tf-keras's fit drives the coordinator itself


def test_overrides_set_nested_keys_with_yaml_types():
    raw = apply_overrides(base_spec(), parse_set_options(["train.epochs=7", "cluster.placement=spread",
                                                          "optimizer.learning_rate=1e-3"]))
    spec = parse(raw)
    assert spec.train.epochs == 7 and spec.cluster.placement == "spread" and spec.optimizer.learning_rate == 0.001
    with pytest.raises(SpecError, match="expected KEY=VALUE"):
        parse_set_options(["train.epochs"])


def test_load_resolves_paths_against_the_job_folder(job_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not the job folder: paths must still resolve
    job = load(write_job(job_dir, base_spec()))
    assert job.job_dir == job_dir
    assert job.data_path("data/digits-train.parquet") == str(job_dir / "data" / "digits-train.parquet")
    assert job.actor_data_path("data/digits-train.parquet") == "data/digits-train.parquet"
    assert job.datasets["train"].num_rows == 1437 and job.datasets["validation"].num_rows == 360
    assert job.output_dir == job_dir / "runs" / "t"


@pytest.mark.parametrize("change,message", [
    ({"model": "tmodel:nope"}, "'tmodel' has no function 'nope'"),
    ({"model": "tmodel:not_a_function"}, "is a int, not a function"),
    ({"model": "missing_mod:f"}, "module 'missing_mod' not found"),
    ({"data": {"train": "data/none.parquet"}}, "data.train: "),
    ({"data": {"features": ["pixel"]}}, "column(s) ['pixel'] not in"),
    ({"loss": "sparse_categorical_crossentropyy"}, "unknown Keras loss"),
    ({"metrics": ["acuracy"]}, "unknown Keras metric 'acuracy'"),
    ({"optimizer": {"name": "adamm"}}, "optimizer: cannot build 'adamm'"),
])
def test_load_errors_name_the_bad_value(job_dir, change, message):
    with pytest.raises(SpecError) as info:
        load(write_job(job_dir, base_spec(**change)))
    assert message in str(info.value)


def test_cli_exits_2_with_a_one_line_error(job_dir):
    path = write_job(job_dir, base_spec(cluster={"workers": 0}))
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 2
    assert result.output.startswith("raytf: error: ") and "cluster.workers" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["run", str(job_dir / "absent.yaml")])
    assert result.exit_code == 2 and "no such job file" in result.output
    result = CliRunner().invoke(main, ["run", str(path), "--set", "nokey"])
    assert result.exit_code == 2 and "expected KEY=VALUE" in result.output


def test_gpu_placement_policies_are_checked_and_per_node_spreads():
    assert "per_gpu needs 0 < gpus_per_worker <= 1, got 2" in error_of(
        base_spec(cluster={"gpu_placement": "per_gpu", "gpus_per_worker": 2}))
    assert "per_node needs gpus_per_worker = the GPUs of a node" in error_of(
        base_spec(cluster={"gpu_placement": "per_node", "gpus_per_worker": 0.5}))
    spec = parse(base_spec(cluster={"gpu_placement": "per_node", "gpus_per_worker": 2, "workers": 2},
                           train={"global_batch_size": 64}))
    assert spec.cluster.effective_placement == "strict_spread" and spec.cluster.replicas == 4
    assert parse(base_spec(cluster={"gpu_placement": "per_gpu", "gpus_per_worker": 0.5})).cluster.replicas == 2
    assert "'float8' is not one of" in error_of(base_spec(train={"precision": "float8"}))


def test_a_spec_without_a_loss_gets_the_default_as_a_loss_spec(job_dir):
    raw = base_spec()
    del raw["loss"]
    job = load(write_job(job_dir, raw))  # imports Keras to check names: a bare default string broke that
    assert job.spec.loss.name == "sparse_categorical_crossentropy" and job.spec.loss.from_logits is False


def test_more_parameter_server_workers_than_rows_is_a_spec_error(job_dir):
    raw = ps(cluster={"ps": 1, "workers": 1500})  # digits-train has 1,437 rows
    with pytest.raises(SpecError, match="data.train has 1437 rows, fewer than cluster.workers 1500"):
        load(write_job(job_dir, raw))


@pytest.mark.parametrize("sections,message", [
    ({"strategy": "parameter_server", "cluster": {"ps": 1}},
     "train.deterministic is not supported with strategy: parameter_server; remove it: workers update the variables "
     "asynchronously"),
    ({"failure": {"elastic": {"min_workers": 1}}},
     "train.deterministic: failure.elastic cannot be reproduced: a restart with fewer workers"),
    ({"data": {**base_spec()["data"], "cache": "memory"}},
     "train.deterministic: data.cache: memory cannot be reproduced: a resumed run fills the cache in another order"),
    ({"data": None, "dataset_fn": "m:f", "train": {"steps_per_epoch": 3, "deterministic": True}},
     "train.deterministic: dataset_fn cannot be reproduced: a resumed run reads your dataset from its start again"),
])
def test_what_cannot_be_deterministic_is_named_with_the_reason(sections, message):
    spec = base_spec(**sections)
    spec["train"] = {**spec["train"], "deterministic": True}
    with pytest.raises(SpecError) as info:
        parse(spec)
    assert message in str(info.value)


def test_a_deterministic_spec_keeps_its_other_keys_and_reads_back_as_it_was():
    spec = parse(base_spec(train={"deterministic": True}))
    again = parse(spec.model_dump())  # a trial's or best.yaml's spec: every key written out, timing included
    assert again.train.deterministic and again.output.timing  # timing stays asked for; the step skips it


def test_a_deterministic_run_refuses_a_checkpoint_that_holds_no_random_state():
    from raytf.actor.mirrored import MirroredRunner

    runner = object.__new__(MirroredRunner)  # only the checkpoint decisions: no strategy, no model
    runner.deterministic = True
    assert runner.checkpoint_extras("unused") == {"deterministic": True}
    runner.check_restorable({"deterministic": True}, "ckpt/step-30")
    with pytest.raises(ValueError, match=r"checkpoint ckpt/step-30 was written by a run without train.deterministic"
                                         r".*resume it without train.deterministic, or start afresh"):
        runner.check_restorable({"step": 30}, "ckpt/step-30")
    runner.deterministic = False  # the other way round is fine: the saved random state is left unused
    runner.check_restorable({"deterministic": True}, "ckpt/step-30")
