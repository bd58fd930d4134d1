"""The tf.distribute guide's other strategies: one_device and central_storage run as mirrored jobs do (data,
checkpoints, export, sweeps), on one task; tpu is refused in one line. Spec rules are pure tests; the jobs
run on the session's local cluster (its GPU nodes have 2 logical GPUs each; TensorFlow runs on CPU)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import raytf
from raytf.errors import SpecError
from raytf.job import parse
from tests.conftest import assert_nothing_left, base_spec, write_job


BN_DROPOUT = textwrap.dedent('''
    import keras

    def build_model():
        return keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
                                 keras.layers.ReLU(), keras.layers.Dropout(0.3), keras.layers.Dense(10)])
''')


def spec_error(**sections) -> str:
    with pytest.raises(SpecError) as info:
        parse(base_spec(**sections))
    return str(info.value)


@pytest.mark.timeout(30)
def test_one_task_strategies_take_one_worker_by_default_and_refuse_what_one_task_cannot_do():
    for strategy in ("one_device", "central_storage"):
        spec = base_spec(strategy=strategy)
        del spec["cluster"]["workers"]
        assert parse(spec).cluster.workers == 1  # the default for one task's strategies
    assert ("cluster.workers: 2 is not supported with strategy: one_device; set cluster.workers: 1"
            in spec_error(strategy="one_device"))
    assert "cluster.gpus_per_worker: 2 is more than the one device" in spec_error(
        strategy="one_device", cluster={"workers": 1, "gpus_per_worker": 2})
    assert "failure.elastic is not supported with strategy: central_storage" in spec_error(
        strategy="central_storage", cluster={"workers": 1}, failure={"elastic": {"min_workers": 1}})
    assert "cluster.ps is for strategy: parameter_server" in spec_error(strategy="central_storage",
                                                                       cluster={"workers": 1, "ps": 1})
    assert "cluster.communication is not supported with strategy: one_device" in spec_error(
        strategy="one_device", cluster={"workers": 1, "communication": "ring"})


@pytest.mark.timeout(30)
def test_a_train_fn_calling_keras3_fit_is_refused_only_where_fit_fails(tmp_path):
    from raytf.job_code import check_train_fn_keras

    (tmp_path / "fits.py").write_text("def train(ctx):\n    model = ctx.config['m']\n    model.fit([], epochs=1)\n")
    spec = {"name": "t", "train_fn": "fits:train"}
    with pytest.raises(SpecError, match=r"calls \.fit\(\) \(line 3\): Keras 3's model.fit fails under MultiWorker"):
        check_train_fn_keras(parse(spec), tmp_path)
    for strategy in ("one_device", "central_storage"):  # Keras 3's fit works under their strategies
        check_train_fn_keras(parse({**spec, "strategy": strategy}), tmp_path)


@pytest.mark.timeout(60)
def test_tpu_is_one_line_exit_2_naming_what_to_use_before_anything_starts(job_dir):
    path = write_job(job_dir, base_spec(strategy="tpu"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(["raytf", "run", str(path)], cwd=job_dir, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("raytf: error: ") and "job.yaml: strategy: tpu: raytf does not run TPUs" in line
    assert "Ray's TPU support on GKE with JAX, or TPUStrategy outside raytf" in line
    assert "one_device, central_storage" in line
    assert not (job_dir / "runs").exists()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_central_storage_computes_on_the_tasks_gpus_with_the_variables_on_its_cpu_and_exports(cluster, job_dir):
    _, gpu_nodes = cluster
    spec = base_spec(name="central", strategy="central_storage", train={"epochs": 2, "global_batch_size": 64},
                     cluster={"workers": 1, "cpus_per_worker": 0.5, "gpus_per_worker": 2},
                     output={"export": ["keras", "saved_model"], "tensorboard": False})
    result = raytf.fit(write_job(job_dir, spec))
    assert result.status == "succeeded" and len(result.tasks) == 1
    [task] = result.tasks
    assert task["node_id"] in {n.node_id for n in gpu_nodes}
    assert sorted(task["cuda_visible_devices"].split(",")) == ["0", "1"]  # the task's two GPUs
    assert result.variable_devices and all(  # one copy of each variable, on the machine's CPU
        len(devices) == 1 and devices[0].endswith("device:CPU:0") for devices in result.variable_devices.values())
    losses = [h["loss"] for h in result.history]
    assert losses[1] < losses[0] and result.history[-1]["val_accuracy"] > 0.8
    assert set(result.exports) == {"keras", "saved_model"}
    assert (job_dir / "runs" / "central" / "saved_model" / "saved_model.pb").is_file()
    assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_sweep_runs_one_device_trials_each_a_job_that_trains_checkpoints_and_exports(cluster, job_dir):
    spec = base_spec(name="single", strategy="one_device", train={"epochs": 2, "global_batch_size": 64},
                     cluster={"workers": 1, "cpus_per_worker": 0.5, "gpus_per_worker": 1},
                     checkpoint={"every_epochs": 1}, output={"export": ["keras", "saved_model"], "tensorboard": False})
    spec["checkpoint"]["dir"] = "ckpt"
    spec["tune"] = {"metric": "val_loss", "mode": "min", "space": {"optimizer.learning_rate": {"grid": [0.003, 0.01]}}}
    result = raytf.tune(write_job(job_dir, spec, "sweep.yaml"))
    assert [r["status"] for r in result.rows] == ["completed", "completed"], result.table
    for row in result.rows:
        trial = job_dir / "runs" / "single" / "trials" / row["point"]
        saved = json.loads((trial / "result.json").read_text())
        assert saved["strategy"] == "one_device" and len(saved["tasks"]) == 1
        assert saved["tasks"][0]["gpu_ids"] and saved["history"][-1]["loss"] < saved["history"][0]["loss"]
        assert (trial / "model.keras").is_file() and (trial / "saved_model" / "saved_model.pb").is_file()
        assert sorted(p.name for p in (job_dir / "ckpt" / row["point"]).iterdir())  # its own checkpoints
    assert "strategy: one_device" in (job_dir / "runs" / "single" / "best.yaml").read_text()
    assert_nothing_left()


TWO_REPLICAS_CENTRAL = textwrap.dedent('''
    import json, sys, types
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
    from raytf.job import load
    from raytf.protocol import WorkerPayload
    from raytf.actor.mirrored import MirroredRunner

    job_dir = sys.argv[1]
    sys.path.insert(0, job_dir)
    # what a GPU machine has: two compute devices, and the CPU holding the variables
    strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:1", "/cpu:2"], parameter_device="/cpu:0")
    job = load(job_dir + "/job.yaml")
    payload = WorkerPayload(job.spec, job.datasets["train"], job.data_path(job.spec.data.train),
                            job.datasets["validation"], job.data_path(job.spec.data.validation))
    ctx = types.SimpleNamespace(world_size=1, rank=0, is_chief=True, staging_dir=job_dir + "/staging")
    runner = MirroredRunner(strategy, payload, ctx)
    losses = []
    for epoch in (1, 2):
        runner.start_epoch(epoch, None)
        for _ in runner.train(runner.steps, epoch):
            pass
        runner.sync_state()
        losses.append(runner.train_acc.results(runner.epoch_totals())["loss"])
    moving = [v for v in runner.model.weights if "moving_mean" in v.path][0]
    print(json.dumps({"replicas": strategy.num_replicas_in_sync, "losses": losses,
                      "devices": sorted({v.value.device for v in runner.model.weights}),
                      "moving_mean_moved": bool(abs(moving.numpy()).sum() > 0)}))
''')


@pytest.mark.timeout(120)
def test_raytfs_loop_under_central_storage_with_two_replicas_trains_batchnorm_and_dropout(job_dir):
    """Two compute devices (logical CPUs standing in for a machine's GPUs), variables on the CPU: raytf's step
    assigns BatchNormalization's statistics and Dropout's state from each replica, which TensorFlow refuses
    for Keras's variables unless raytf says how replicas combine (tier 2: in a subprocess, no Ray)."""
    (job_dir / "bn_dropout.py").write_text(BN_DROPOUT)
    write_job(job_dir, base_spec(strategy="central_storage", model="bn_dropout:build_model",
                                 cluster={"workers": 1}, train={"epochs": 2, "global_batch_size": 64}))
    proc = subprocess.run([sys.executable, "-c", TWO_REPLICAS_CENTRAL, str(job_dir)], capture_output=True, text=True,
                          timeout=110, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2 and out["devices"] == ["/job:localhost/replica:0/task:0/device:CPU:0"]
    assert out["losses"][1] < out["losses"][0] and out["moving_mean_moved"]


@pytest.mark.timeout(30)
def test_a_parsed_spec_switched_to_another_strategy_takes_that_strategys_worker_count(job_dir):
    """A sweep's point or pbt's choice overrides a parsed job, which carries every key: a worker count that was
    only the old strategy's default follows the new strategy; one given as an override stays."""
    from raytf.job import load

    mirrored = load(write_job(job_dir, {k: v for k, v in base_spec().items() if k != "cluster"}), check_code=False)
    assert mirrored.spec.cluster.workers == 2
    assert load(mirrored, {"strategy": "one_device"}, check_code=False).spec.cluster.workers == 1
    single = load(mirrored, {"strategy": "central_storage"}, check_code=False)
    assert load(single, {"strategy": "mirrored"}, check_code=False).spec.cluster.workers == 2
    assert load(single, {"strategy": "mirrored", "cluster.workers": 4}, check_code=False).spec.cluster.workers == 4
    with pytest.raises(SpecError, match="cluster.workers: 3 is not supported with strategy: one_device"):
        load(mirrored, {"strategy": "one_device", "cluster.workers": 3}, check_code=False)
