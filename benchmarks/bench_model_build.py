"""Building a model under MultiWorkerMirroredStrategy, side by side in one run: TensorFlow's own way (each new
variable gets worker 0's initial value by a broadcast of its own) vs raytf's (`raytf.actor.initial_values`:
each worker's own value, a checksum compared with worker 0's, only differing variables sent). ResNet50 (no
pretrained weights: nothing downloaded) with Adam's slots, 2 workers on localhost, each seeded alike as raytf
seeds them. Measured: the seconds from entering the strategy's scope to a built model and optimizer, the same
on both workers (they wait for each other), medians of the reps, interleaved; and that both ways end with
equal weights on both workers.

    python benchmarks/bench_model_build.py [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WORKER = r'''
import contextlib, hashlib, json, os, sys, time
rank, ports, packed = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3] == "raytf"
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                      "task": {"type": "worker", "index": rank}})
os.environ["TF_GRPC_DEFAULT_OPTIONS"] = "grpc.initial_reconnect_backoff_ms=50"
import keras, tensorflow as tf
from raytf.actor import initial_values
tf.config.threading.set_intra_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(0)
started = time.time()
with strategy.scope(), (initial_values.one_broadcast(strategy) if packed else contextlib.nullcontext()):
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
built = time.time() - started
variables = model.variables + optimizer.variables
print(json.dumps({"build_s": built, "variables": len(variables),
                  "digest": hashlib.sha256(b"".join(v.numpy().tobytes() for v in variables)).hexdigest()}))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_build(way: str) -> dict:
    ports = ",".join(str(_free_port()) for _ in range(2))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), ports, way], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for rank in range(2)]
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    assert outs[0]["digest"] == outs[1]["digest"], f"{way}: the workers' weights differ"
    return {"build_s": max(o["build_s"] for o in outs), "variables": outs[0]["variables"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ways = {"tensorflow": "TensorFlow's broadcast per variable", "raytf": "raytf.actor.initial_values"}
    rows: dict[str, list[dict]] = {w: [] for w in ways}
    for rep in range(args.reps):
        for way in ways:
            rows[way].append(one_build(way))
        print(f"rep {rep + 1}: " + json.dumps({w: round(r[-1]["build_s"], 2) for w, r in rows.items()}), flush=True)
    base = statistics.median(r["build_s"] for r in rows["tensorflow"])
    print(f"\nResNet50 + Adam ({rows['raytf'][0]['variables']} variables), 2 workers on localhost; "
          f"median of {args.reps} reps, interleaved\n")
    print("| way | build (s), each rep | median | vs TensorFlow's |\n|---|---|---:|---:|")
    for way, label in ways.items():
        times = [r["build_s"] for r in rows[way]]
        print(f"| {label} | {', '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} | "
              f"{statistics.median(times) / base:.2f}x |")


if __name__ == "__main__":
    main()
