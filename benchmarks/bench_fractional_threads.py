"""What a fractional-CPU worker's thread pools cost, side by side in one run: several TensorFlow processes on this
machine's cores at once (as workers with cpus_per_worker below 1 share a node), each training the same small CNN
with a custom step: TensorFlow's default pools (one intra-op thread per core: raytf before 2026-12-06 for
cpus_per_worker < 1), one intra-op thread (max(1, int(cpus)), inter-op 2: raytf until the next change), and one
intra-op thread whose idle pool threads do not spin (ConfigProto.experimental.disable_thread_spinning: raytf now,
raytf.actor.task_actor.thread_pools). Interleaved per rep; the CPU seconds (user + system) and wall seconds of each
process's steps, after tracing.

    python benchmarks/bench_fractional_threads.py [--procs 3] [--steps 1500] [--reps 3]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

WORKER = r'''
import resource, sys, time
intra, steps, spinning = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
from raytf.tf_import import import_tensorflow
import_tensorflow()
import keras, numpy as np, tensorflow as tf
if intra:
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(2)
if not spinning:
    from raytf.actor.task_actor import _disable_thread_spinning
    _disable_thread_spinning()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.Flatten(),
                          keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
optimizer, loss = keras.optimizers.Adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
x, y = np.random.rand(32, 8, 8, 1).astype("float32"), np.random.randint(0, 10, 32)
@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))
step(x, y)
before, started = resource.getrusage(resource.RUSAGE_SELF), time.time()
for _ in range(steps):
    step(x, y)
after = resource.getrusage(resource.RUSAGE_SELF)
print(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, time.time() - started)
'''

WAYS = {"default pools (one intra-op thread per core)": (0, True),
        "one intra-op thread, spinning (the previous head)": (1, True),
        "one intra-op thread, no spinning (raytf for cpus < 1)": (1, False)}


def together(way: tuple[int, bool], procs: int, steps: int) -> list[tuple[float, float]]:
    intra, spinning = way
    runs = [subprocess.Popen([sys.executable, "-c", WORKER, str(intra), str(steps), str(int(spinning))], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True) for _ in range(procs)]
    return [tuple(float(v) for v in run.communicate()[0].split()) for run in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cpu: dict[str, list[float]] = {name: [] for name in WAYS}
    wall: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(args.reps):
        for name, way in WAYS.items():
            for c, w in together(way, args.procs, args.steps):
                cpu[name].append(c)
                wall[name].append(w)
    base = statistics.median(cpu["one intra-op thread, spinning (the previous head)"])
    print(f"| {args.procs} processes at once, {args.steps} steps each | CPU s (median) | wall s (median) | "
          f"CPU vs the previous head |")
    print("|---|---:|---:|---:|")
    for name in WAYS:
        med = statistics.median(cpu[name])
        print(f"| {name} | {med:.2f} | {statistics.median(wall[name]):.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
