"""The wide-and-deep click-through job (jobs/criteo-ps.yaml) under ParameterServerStrategy at 1, 2 and 4
workers, and the same model, data and global batch under MultiWorkerMirroredStrategy at the same worker
counts: side by side in one run, interleaved per rep.

    python benchmarks/bench_ps.py [--reps 1] [--epochs 3] [--workers 1 2 4]

Reported per way: steady-state examples/s (examples after the first step / time after it, on the
chief) and wall time. Ray starts once, before any timing, with enough logical CPUs for the largest
job: the jobs then share this machine's real cores, which is what is measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "criteo-ps.yaml"
PS_KEYS = ("ps", "cpus_per_ps", "cpus_per_chief", "evaluator", "variable_partitioner")


def job_file(strategy: str, workers: int, epochs: int) -> Path:
    """A copy of the example job for one way, in the jobs/ folder (its model module and data are there)."""
    spec = yaml.safe_load(JOB.read_text())
    spec["train"]["epochs"] = epochs
    spec["cluster"]["workers"] = workers
    spec["output"] = {"dir": tempfile.mkdtemp(prefix="bench-ps-"), "tensorboard": False}
    spec["strategy"] = strategy
    if strategy == "mirrored":
        for key in PS_KEYS:
            spec["cluster"].pop(key, None)
    path = JOB.parent / f".bench-{strategy}-{workers}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_one(strategy: str, workers: int, epochs: int) -> dict:
    import raytf

    path = job_file(strategy, workers, epochs)
    try:
        started = time.time()
        result = raytf.fit(str(path))
        return {"examples_per_s": result.examples_per_s, "wall_s": time.time() - started,
                "loss": result.history[-1]["loss"], "val_auc": result.history[-1].get("val_auc")}
    finally:
        path.unlink(missing_ok=True)


def table(rows: dict[str, list[dict]], baseline: str) -> str:
    med = {way: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for way, runs in rows.items()}
    base = med[baseline]["examples_per_s"]
    lines = ["| way | examples/s | vs " + baseline + " | wall (s) | final loss | val AUC |",
             "|---|---:|---:|---:|---:|---:|"]
    for way, m in med.items():
        lines.append(f"| {way} | {m['examples_per_s']:,.0f} | {m['examples_per_s'] / base:.2f}x | "
                     f"{m['wall_s']:.1f} | {m['loss']:.4f} | {m['val_auc']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()

    import keras  # noqa: F401  (the driver's one-time import; not part of any timing)
    import ray

    ray.init(address="local", num_cpus=2 * max(args.workers) + 2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "2"}})
    ways = [(s, w) for w in args.workers for s in ("parameter_server", "mirrored")]
    rows: dict[str, list[dict]] = {f"{s} x{w}": [] for s, w in ways}
    for rep in range(args.reps):
        for strategy, workers in ways:
            rows[f"{strategy} x{workers}"].append(run_one(strategy, workers, args.epochs))
            print(f"rep {rep + 1} {strategy} x{workers}: {json.dumps(rows[f'{strategy} x{workers}'][-1])}", flush=True)
    ray.shutdown()
    spec = yaml.safe_load(JOB.read_text())
    print(f"\njobs/criteo-ps.yaml model, global batch {spec['train']['global_batch_size']}, {args.epochs} epochs, "
          f"{spec['cluster']['ps']} ps, median of {args.reps} rep(s), {os.cpu_count()} CPUs\n")
    print(table(rows, baseline=f"mirrored x{args.workers[0]}"))


if __name__ == "__main__":
    main()
