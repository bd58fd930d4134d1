"""What a MultiWorkerMirrored survivor holds when its peer is killed mid-run (the ground for issue 40's zero steps
lost: a restart from a survivor's memory instead of the last checkpoint). Two worker processes on localhost, no Ray:
a Keras 3 model with BatchNormalization, Adam, a custom `strategy.run` step; rank 1 exits hard before step
KILL_AT. Rank 0 reports how its failing step ended, how long reading every variable and writing a
tf.train.Checkpoint of them takes (no collective), `optimizer.iterations` and a sum added after each step (as
raytf's metric sums are) against the steps it completed, and whether its weights are those of before the failed
step (raytf.actor.rescue relies on all three).

    python benchmarks/survivor_state.py
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

KILL_AT = 30

WORKER = r'''
import json, os, sys, time
rank, ports, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                      "task": {"type": "worker", "index": rank}})
import numpy as np, tensorflow as tf, keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(10)])
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
rng = np.random.RandomState(rank)
x, y = rng.rand(32, 64).astype("float32"), rng.randint(0, 10, 32)

counter = tf.Variable(0.0)  # a local sum added after each step, as raytf's metric sums are

@tf.function
def step():
    def replica(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return tf.constant(1.0)
    counter.assign_add(tf.add_n(list(strategy.experimental_local_results(strategy.run(replica, args=(x, y))))))

done = 0
for i in range(10 * KILL_AT):
    if rank == 1 and i == KILL_AT:
        os._exit(1)
    before = [v.numpy() for v in model.trainable_variables]
    try:
        step()
        done += 1
    except Exception as exc:
        t = time.perf_counter()
        arrays = [v.numpy() for v in model.weights] + [v.numpy() for v in opt.variables]
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        tf.train.Checkpoint(model=model, optimizer=opt).write(os.path.join(out, "state"))
        write_s = time.perf_counter() - t
        print(json.dumps({"error": type(exc).__name__, "steps_done": done, "iterations": int(opt.iterations.numpy()),
                          "arrays": len(arrays), "finite": bool(all(np.isfinite(a).all() for a in arrays)), "counter": float(counter.numpy()),
                          "weights_as_before_the_failed_step": all(np.array_equal(a, v.numpy())
                                                                   for a, v in zip(before, model.trainable_variables)),
                          "read_s": round(read_s, 4), "checkpoint_write_s": round(write_s, 4)}), flush=True)
        break
'''.replace("KILL_AT", str(KILL_AT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ports = f"{free_port()},{free_port()}"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    with tempfile.TemporaryDirectory() as out:
        started = time.time()
        survivor = subprocess.Popen([sys.executable, "-c", WORKER, "0", ports, out], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
        peer = subprocess.Popen([sys.executable, "-c", WORKER, "1", ports, out], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        said = survivor.communicate(timeout=300)[0].strip().splitlines()
        peer.wait(timeout=60)
    report = json.loads(said[-1]) if said else {"error": "no report"}
    report["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
