"""The same small job three ways, side by side in one run: raytf, hand-launched TF processes with a
hand-written TF_CONFIG (no Ray), and Ray Train's TensorflowTrainer (tf-keras `model.fit`, since Keras 3
`fit` fails under MultiWorkerMirroredStrategy).

    pip install -e '.[bench]' && python benchmarks/bench_core.py [--reps 3] [--epochs 5]

Ray is started once, before any timing ("with Ray already running"). Reported per way: time to first
step (launch -> first training step done on the chief), total wall time (launch -> all workers done),
steady-state examples/s (examples after the first step / time after the first step). Medians over reps.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "digits.yaml"
WORKERS = 2


def overrides(epochs: int, out: str, extra: dict | None = None) -> dict:
    return {"train.epochs": epochs, "cluster.workers": WORKERS, "output.dir": out, "output.tensorboard": False,
            **(extra or {})}


def run_raytf(epochs: int, job: Path = JOB, extra: dict | None = None) -> dict:
    import raytf

    started = time.time()
    result = raytf.fit(str(job), overrides(epochs, tempfile.mkdtemp(), extra))
    print("raytf phases:", result.phases, flush=True)
    return {"first_step_s": result.time_to_first_step_s, "total_s": time.time() - started,
            "examples_per_s": result.examples_per_s, "loss": result.history[-1]["loss"]}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_hand_launched(epochs: int, global_batch: int, job: Path = JOB, extra: dict | None = None) -> dict:
    ports = _free_ports(WORKERS)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    started = time.time()
    procs = []
    for index in range(WORKERS):
        # OMP_NUM_THREADS=1 as Ray sets it for a 1-CPU actor, so both ways get the same threading.
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "hand_worker.py"), str(job),
                                       json.dumps(overrides(epochs, tempfile.mkdtemp(), extra))],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    total = time.time() - started
    if any(p.returncode for p in procs):
        raise RuntimeError(f"hand-launched workers failed: {[p.returncode for p in procs]}")
    chief = json.loads(outputs[0].strip().splitlines()[-1])
    return {"first_step_s": chief["first_step_at"] - started, "total_s": total,
            "examples_per_s": (chief["steps"] - 1) * global_batch / (chief["finished_at"] - chief["first_step_at"]),
            "loss": chief["loss"]}


def _ray_train_loop(config: dict) -> None:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import pyarrow.parquet as pq
    import tensorflow as tf
    import ray.train

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
    marks = {}

    class Timing(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.setdefault("first_step_at", time.time())

    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(config["batch"])  # validated every epoch, as raytf does
    history = model.fit(ds, epochs=config["epochs"], steps_per_epoch=steps, validation_data=val, verbose=0,
                        callbacks=[Timing()])
    # Same machine: the chief's timings go through a file (Ray Train V2's Result carries metrics only
    # alongside a checkpoint).
    if ray.train.get_context().get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps({"first_step_at": marks["first_step_at"], "finished_at": time.time(),
                                                   "steps": steps * config["epochs"],
                                                   "loss": history.history["loss"][-1]}))


def run_ray_train(epochs: int, global_batch: int, lr: float) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    out = Path(tempfile.mkdtemp()) / "chief.json"
    config = {"train": str(REPO / "jobs" / "data" / "digits-train.parquet"),
              "validation": str(REPO / "jobs" / "data" / "digits-test.parquet"), "batch": global_batch, "lr": lr,
              "epochs": epochs, "out": str(out)}
    trainer = TensorflowTrainer(_ray_train_loop, train_loop_config=config,
                                scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 1}),
                                run_config=RunConfig(storage_path=tempfile.mkdtemp(), name="bench"))
    started = time.time()
    trainer.fit()
    total = time.time() - started
    m = json.loads(out.read_text())
    return {"first_step_s": m["first_step_at"] - started, "total_s": total,
            "examples_per_s": (m["steps"] - 1) * global_batch / (m["finished_at"] - m["first_step_at"]),
            "loss": m["loss"]}


def table(rows: dict[str, list[dict]]) -> str:
    med = {way: {k: statistics.median(r[k] for r in runs) for k in ("first_step_s", "total_s", "examples_per_s")}
           for way, runs in rows.items()}
    base = med["hand-launched"]
    lines = ["| way | first step (s) | total (s) | steady ex/s | total vs hand | ex/s vs hand | total vs raytf |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for way, m in med.items():
        lines.append(f"| {way} | {m['first_step_s']:.2f} | {m['total_s']:.2f} | {m['examples_per_s']:,.0f} | "
                     f"{m['total_s'] / base['total_s']:.2f}x | {m['examples_per_s'] / base['examples_per_s']:.2f}x | "
                     f"{m['total_s'] / med['raytf']['total_s']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--skip-ray-train", action="store_true")
    args = parser.parse_args()

    import keras  # noqa: F401  (the driver's one-time import, as in a notebook; not part of any timing)
    import ray
    import yaml

    spec = yaml.safe_load(JOB.read_text())
    global_batch, lr = spec["train"]["global_batch_size"], spec["optimizer"]["learning_rate"]
    # tf-keras for Ray Train's model.fit; raytf imports Keras 3 as `keras` and is unaffected.
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}})
    rows: dict[str, list[dict]] = {"raytf": [], "hand-launched": []}
    if not args.skip_ray_train:
        rows["Ray Train TensorflowTrainer"] = []
    for rep in range(args.reps):  # interleaved, so drift on the machine hits every way alike
        rows["hand-launched"].append(run_hand_launched(args.epochs, global_batch))
        rows["raytf"].append(run_raytf(args.epochs))
        if not args.skip_ray_train:
            rows["Ray Train TensorflowTrainer"].append(run_ray_train(args.epochs, global_batch, lr))
        print(f"rep {rep + 1}: " + json.dumps({w: {k: round(v, 2) for k, v in r[-1].items()} for w, r in rows.items()}),
              flush=True)
    ray.shutdown()
    print(f"\n{WORKERS} workers, digits MLP, global batch {global_batch}, {args.epochs} epochs, "
          f"median of {args.reps} reps, {os.cpu_count()} CPUs\n")
    print(table(rows))


if __name__ == "__main__":
    main()
