"""Your own loop through raytf against the same loop in hand-launched TF processes: jobs/digits-custom.yaml's
train_fn (strategy.run + strategy.reduce over ctx.distributed_dataset), side by side in one run.

    python benchmarks/bench_own_loop.py [--reps 3] [--epochs 5]

The hand-launched way is two plain Python processes with a hand-written TF_CONFIG running the same train_fn
with the same ctx (benchmarks/hand_worker.py): what remains is what raytf's orchestration costs. Neither way
checkpoints (checkpoint.dir: null), so both run the same steps. Ray is started once, before any timing.
Reported: steady-state examples/s (examples after the first step / time after it), time to the first step
and total time, medians over reps, and raytf / hand-launched.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from bench_core import REPO, WORKERS, run_hand_launched, run_raytf

JOB = REPO / "jobs" / "digits-custom.yaml"
SAME_WORK = {"checkpoint.dir": None, "failure.max_restarts": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    import ray
    import yaml

    global_batch = yaml.safe_load(JOB.read_text())["train"]["global_batch_size"]
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    rows: dict[str, list[dict]] = {"hand-launched": [], "raytf": []}
    for rep in range(args.reps):  # interleaved, so drift on the machine hits both alike
        rows["hand-launched"].append(run_hand_launched(args.epochs, global_batch, JOB, SAME_WORK))
        rows["raytf"].append(run_raytf(args.epochs, JOB, SAME_WORK))
        print(f"rep {rep + 1}: " + json.dumps({w: {k: round(v, 2) for k, v in r[-1].items()} for w, r in rows.items()}),
              flush=True)
    ray.shutdown()
    med = {way: {k: statistics.median(r[k] for r in runs) for k in ("first_step_s", "total_s", "examples_per_s")}
           for way, runs in rows.items()}
    print(f"\n{WORKERS} workers, digits-custom train_fn, global batch {global_batch}, {args.epochs} epochs, "
          f"median of {args.reps} reps, {os.cpu_count()} CPUs\n")
    print("| way | first step (s) | total (s) | steady ex/s | reps (ex/s) |")
    print("|---|---:|---:|---:|---|")
    for way, m in med.items():
        reps = ", ".join(f"{r['examples_per_s']:,.0f}" for r in rows[way])
        print(f"| {way} | {m['first_step_s']:.2f} | {m['total_s']:.2f} | {m['examples_per_s']:,.0f} | {reps} |")
    print(f"\nraytf / hand-launched, steady ex/s: {med['raytf']['examples_per_s'] / med['hand-launched']['examples_per_s']:.3f}")


if __name__ == "__main__":
    main()
