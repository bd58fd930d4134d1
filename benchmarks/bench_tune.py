"""The same sweep two ways, side by side in one run: `raytf tune` (every trial a raytf job) and Ray Tune
running Ray Train's TensorflowTrainer in each trial (tf-keras `model.fit`, since Keras 3 `fit` fails under
MultiWorkerMirroredStrategy), the pattern Ray's docs give for Train V2 + Tune.

    pip install -e '.[bench]' && python benchmarks/bench_tune.py [--reps 1] [--epochs 5]

The sweep: digits MLP, global batch {64, 128} x learning rate {0.001, 0.004} (scaled linearly with the
batch), 4 trials x 2 workers, validation every epoch, no early stopping, on one local Ray with as many
CPUs as the machine. Resources per trial are the same: raytf 2 workers x 0.5 CPU (its trial actor takes
none); Ray Train 2 workers x 0.45 CPU + 0.1 CPU for the trial's driver, with max_concurrent_trials set
by hand to what fits (2 on 2 CPUs), which raytf's `auto` works out by itself.

A third way is raytf with `tune.reuse_processes: false` (every trial starts new worker processes, as before
raytf kept them): what running a trial in the previous one's processes saves.

Reported per way: sweep wall time (call -> results), mean trial time, cluster utilization (sum of trial
time x reserved CPUs / (sweep wall x cluster CPUs)) and the best final val_loss, as a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWEEP = REPO / "jobs" / "digits-sweep.yaml"
BATCHES, LRS, BASE_BATCH = [64, 128], [0.001, 0.004], 64
WORKERS = 2


def run_raytf(epochs: int, reuse: bool = True) -> dict:
    """`reuse`: tune.reuse_processes (a trial runs in the processes of the one before it)."""
    import raytf

    started = time.time()
    result = raytf.tune(str(SWEEP), {
        "train.epochs": epochs, "cluster.workers": WORKERS, "cluster.cpus_per_worker": 0.5,
        "output.dir": tempfile.mkdtemp(prefix="bench-tune-"), "output.tensorboard": False,
        "tune.space.train.global_batch_size": {"grid": BATCHES},
        "tune.space.optimizer.learning_rate": {"grid": LRS},
        "tune.lr_scaling": {"rule": "linear", "base_batch_size": BASE_BATCH},
        "tune.scheduler": None, "tune.max_concurrent_trials": "auto", "tune.reuse_processes": reuse})
    wall = time.time() - started
    times = [r["time_s"] for r in result.rows]
    assert all(r["status"] == "completed" for r in result.rows), result.table
    return {"wall_s": wall, "trials": len(result.rows), "concurrency": result.max_concurrent_trials,
            "trial_s": statistics.mean(times), "busy_cpu_s": sum(t * r["cpus"] for t, r in zip(times, result.rows)),
            "best_val_loss": min(r["final"] for r in result.rows)}


def _ray_train_worker(config: dict) -> None:
    """One Ray Train worker: tf-keras model.fit under MultiWorkerMirroredStrategy; val_loss each epoch."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import pyarrow.parquet as pq
    import ray.train
    import tensorflow as tf

    def arrays(path):
        table = pq.read_table(path)
        return np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).astype("float32"), \
            table.column("label").to_numpy()

    (x, y), (xv, yv) = arrays(config["train"]), arrays(config["validation"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(128, activation="relu"),
                                     tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(10)])
        model.compile(optimizer=tf.keras.optimizers.Adam(config["lr"]),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    steps = len(y) // config["batch"]
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10_000, seed=0).repeat().batch(config["batch"])
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(config["batch"])

    class Report(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            ray.train.report({"epoch": epoch + 1, "val_loss": float(logs["val_loss"]), "loss": float(logs["loss"])})

    model.fit(ds, epochs=config["epochs"], steps_per_epoch=steps, validation_data=val, verbose=0,
              callbacks=[Report()])


def _ray_train_trial(config: dict) -> None:
    """One Tune trial: a TensorflowTrainer run whose per-epoch reports reach Tune."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    trainer = TensorflowTrainer(
        _ray_train_worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 0.45}),
        run_config=RunConfig(storage_path=config["storage"], name=f"trial-{uuid.uuid4().hex[:8]}",
                             callbacks=[TuneReportCallback()]))
    trainer.fit()


def run_ray_tune_train(epochs: int) -> dict:
    from ray import tune

    storage = tempfile.mkdtemp(prefix="bench-tune-rt-")
    points = [{"batch": b, "lr": lr * b / BASE_BATCH} for b in BATCHES for lr in LRS]  # the same scaled points
    config = {"point": tune.grid_search(points), "epochs": epochs, "storage": storage,
              "train": str(REPO / "jobs" / "data" / "digits-train.parquet"),
              "validation": str(REPO / "jobs" / "data" / "digits-test.parquet")}

    def trial(cfg):
        _ray_train_trial({**cfg, **cfg["point"]})

    tuner = tune.Tuner(tune.with_resources(trial, {"CPU": 0.1}), param_space=config,
                       tune_config=tune.TuneConfig(metric="val_loss", mode="min", max_concurrent_trials=2),
                       run_config=tune.RunConfig(storage_path=storage, name="sweep", verbose=0))
    started = time.time()
    results = tuner.fit()
    wall = time.time() - started
    assert not results.errors, results.errors
    times = [r.metrics["time_total_s"] for r in results]
    return {"wall_s": wall, "trials": len(times), "concurrency": 2, "trial_s": statistics.mean(times),
            "busy_cpu_s": sum(t * (0.1 + WORKERS * 0.45) for t in times),
            "best_val_loss": min(r.metrics["val_loss"] for r in results)}


def table(rows: dict[str, list[dict]], cpus: float) -> str:
    med = {way: {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "trial_s", "busy_cpu_s", "best_val_loss")}
           for way, runs in rows.items()}
    base = med["Ray Tune + Ray Train"]["wall_s"]
    lines = ["| way | trials x workers | concurrent | sweep wall (s) | mean trial (s) | utilization | best val_loss | wall vs Ray Tune + Ray Train |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for way, m in med.items():
        first = rows[way][0]
        lines.append(f"| {way} | {first['trials']} x {WORKERS} | {first['concurrency']} | {m['wall_s']:.1f} | "
                     f"{m['trial_s']:.1f} | {m['busy_cpu_s'] / (m['wall_s'] * cpus):.0%} | {m['best_val_loss']:.3f} | "
                     f"{m['wall_s'] / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    import keras  # noqa: F401  (the driver's one-time import, as in a notebook; not part of any timing)
    import ray
    import ray.train.tensorflow  # noqa: F401  (likewise for the Ray Train driver)

    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"  # Tune's banners off for both ways (raytf turns them off itself)
    cpus = os.cpu_count() or 2
    # tf-keras for Ray Train's model.fit; raytf imports Keras 3 as `keras` and is unaffected.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}})
    fresh = "raytf tune, new processes each trial"
    rows: dict[str, list[dict]] = {"raytf tune": [], fresh: [], "Ray Tune + Ray Train": []}
    for rep in range(args.reps):  # alternate the order, so drift on the machine hits every way alike
        ways = [("raytf tune", run_raytf), (fresh, lambda epochs: run_raytf(epochs, reuse=False)),
                ("Ray Tune + Ray Train", run_ray_tune_train)]
        for way, fn in (ways if rep % 2 == 0 else ways[::-1]):
            rows[way].append(fn(args.epochs))
            print(f"rep {rep + 1} {way}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in rows[way][-1].items()), flush=True)
    ray.shutdown()
    print(f"\n4 trials (global batch {BATCHES} x lr {LRS}, linear scaling) x {WORKERS} workers, digits MLP, "
          f"{args.epochs} epochs, validation each epoch, median of {args.reps} rep(s), {cpus} CPUs\n")
    print(table(rows, cpus))


if __name__ == "__main__":
    main()
