"""Rows/s delivered to a training step by one worker, side by side in one run, on the same Parquet files:
the in-memory ceiling (`from_tensor_slices` on arrays already in memory), raytf's Parquet pipeline
(with and without shuffling), Ray Data `to_tf` and Ray Data `iter_tf_batches`. Then raytf's peak memory
while streaming a data set several times larger than its shuffle buffer.

    pip install -e . && python benchmarks/bench_ingest.py [--rows 400000] [--reps 3]

The "training step" is a tf.function that reduces the batch, so the figure is what an input pipeline
can feed, not what a model can eat. One process, batch 256, 16 float32 feature columns + an int64 label.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 256
WIDTH = 16


LAYOUTS = {  # name -> (feature columns, whether x is one fixed-size-list column)
    "16 scalar columns": ([f"x{j}" for j in range(WIDTH)], False),
    "one vector[16] column": (["x"], True),
}


def make_data(folder: Path, rows: int, vector: bool, files: int = 4) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for i in range(files):
        n = rows // files
        x = rng.normal(size=(n, WIDTH)).astype(np.float32)
        columns = {"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), WIDTH)} if vector else \
            {f"x{j}": x[:, j] for j in range(WIDTH)}
        pq.write_table(pa.table({**columns, "label": (x[:, 0] > 0).astype(np.int64)}), folder / f"part-{i}.parquet",
                       row_group_size=32_768)


def consume(dataset) -> tuple[int, float]:
    """Feed every batch to a trivial compiled step; returns (rows, seconds)."""
    import tensorflow as tf

    @tf.function
    def step(x, y):
        return tf.add_n([tf.reduce_sum(v) for v in tf.nest.flatten(x)]) + tf.cast(tf.reduce_sum(y), tf.float32)

    rows = 0
    started = time.perf_counter()
    for x, y in dataset:
        step(x, y)
        rows += int(y.shape[0])
    return rows, time.perf_counter() - started


def ceiling(folder: Path, features: list[str], vector: bool) -> float:
    """from_tensor_slices on arrays already in memory: a (rows, 16) matrix, or one array per column."""
    import pyarrow.parquet as pq
    import tensorflow as tf

    table = pq.read_table(folder)
    if vector:
        x = np.stack(table.column("x").to_numpy(zero_copy_only=False)).astype(np.float32)
    else:
        x = {f: table.column(f).to_numpy() for f in features}
    y = table.column("label").to_numpy()
    rows, seconds = consume(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
                            .prefetch(tf.data.AUTOTUNE))
    return rows / seconds


def raytf_pipeline(folder: Path, features: list[str], shuffle_buffer: int) -> float:
    from raytf import data, data_scan
    from raytf.actor import pipelines

    info = data_scan.read_info(str(folder), features, "label")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    steps = info.num_rows // BATCH
    ds = pipelines.train_dataset(info, str(folder), shard, BATCH, steps, shuffle_buffer, seed=0).take(steps)
    rows, seconds = consume(ds)
    return rows / seconds


def ray_data_to_tf(folder: Path, features: list[str]) -> float:
    import ray

    ds = ray.data.read_parquet(str(folder))
    cols = features[0] if len(features) == 1 else features
    tf_ds = ds.to_tf(feature_columns=cols, label_columns="label", batch_size=BATCH, drop_last=True)
    rows, seconds = consume(tf_ds)
    return rows / seconds


def ray_data_iter_tf_batches(folder: Path, features: list[str]) -> float:
    import ray

    ds = ray.data.read_parquet(str(folder))

    def batches():
        for b in ds.iter_tf_batches(batch_size=BATCH, drop_last=True):
            yield (b[features[0]] if len(features) == 1 else {f: b[f] for f in features}), b["label"]

    rows, seconds = consume(batches())
    return rows / seconds


PEAK_SCRIPT = """
import json, sys, threading, time
import tensorflow as tf
from raytf import data, data_scan
from raytf.actor import pipelines

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

folder, shuffle_buffer = sys.argv[1], int(sys.argv[2])
info = data_scan.read_info(folder, ["x%d" % j for j in range(16)], "label")
shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
steps = info.num_rows // 256
it = iter(pipelines.train_dataset(info, folder, shard, 256, steps, shuffle_buffer, seed=0).take(steps))
next(it)  # pipeline built and running
baseline, peak, done = rss_mib(), [0.0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss_mib())
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
n = 256
for x, y in it:
    n += int(y.shape[0])
done.append(1)
print(json.dumps({"rows": n, "peak_mib": max(peak[0], rss_mib()), "before_mib": baseline}))
"""


def peak_memory(folder: Path, shuffle_buffer: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(folder), str(shuffle_buffer)],
                         capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--memory-rows", type=int, default=4_000_000)
    parser.add_argument("--skip-ray-data", action="store_true")
    args = parser.parse_args()

    import ray

    work = Path(tempfile.mkdtemp(prefix="raytf-ingest-"))
    if not args.skip_ray_data:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=os.cpu_count())
        ray.data.DataContext.get_current().enable_progress_bars = False
    print(f"{args.rows:,} rows x {WIDTH} float32 + int64 label in 4 files (row groups of 32,768), batch {BATCH}, "
          f"one process, median of {args.reps}, {os.cpu_count()} CPUs")
    for layout, (features, vector) in LAYOUTS.items():
        folder = work / ("vector" if vector else "scalars")
        folder.mkdir()
        make_data(folder, args.rows, vector)
        ways = {
            "in-memory ceiling (from_tensor_slices)": lambda: ceiling(folder, features, vector),
            "raytf Parquet (shuffle_buffer 10,000)": lambda: raytf_pipeline(folder, features, 10_000),
            "raytf Parquet (no shuffle)": lambda: raytf_pipeline(folder, features, 0),
        }
        if not args.skip_ray_data:
            ways["Ray Data to_tf"] = lambda: ray_data_to_tf(folder, features)
            ways["Ray Data iter_tf_batches"] = lambda: ray_data_iter_tf_batches(folder, features)
        rates: dict[str, list] = {name: [] for name in ways}
        for rep in range(args.reps):  # interleaved reps: machine drift hits every way alike
            for name, fn in ways.items():
                try:
                    rates[name].append(fn())
                except Exception as exc:  # e.g. to_tf on a vector column
                    rates[name].append(f"fails: {type(exc).__name__}")
        med = {k: (statistics.median(v) if all(isinstance(x, float) for x in v) else v[0]) for k, v in rates.items()}
        top = med["in-memory ceiling (from_tensor_slices)"]
        base = med.get("Ray Data to_tf")
        print(f"\n{layout}:\n\n| pipeline | rows/s | vs ceiling | vs Ray Data to_tf |\n|---|---:|---:|---:|")
        for name, rate in med.items():
            if isinstance(rate, str):
                print(f"| {name} | {rate} | - | - |")
                continue
            vs_base = f"{rate / base:.1f}x" if isinstance(base, float) else "-"
            print(f"| {name} | {rate:,.0f} | {rate / top:.2f}x | {vs_base} |", flush=True)

    big = work / "big"
    big.mkdir()
    make_data(big, args.memory_rows, vector=False, files=8)
    table_mib = args.memory_rows * (WIDTH * 4 + 8) / 2**20
    print(f"\nPeak memory streaming {args.memory_rows:,} rows ({table_mib:,.0f} MiB as arrays) through raytf:\n")
    print("| shuffle_buffer | RSS after the first batch (MiB) | peak RSS while streaming (MiB) | growth (MiB) |\n"
          "|---:|---:|---:|---:|")
    for buffer in (10_000, 100_000):
        m = peak_memory(big, buffer)
        print(f"| {buffer:,} | {m['before_mib']:,.0f} | {m['peak_mib']:,.0f} | {m['peak_mib'] - m['before_mib']:,.0f} |")


if __name__ == "__main__":
    main()
