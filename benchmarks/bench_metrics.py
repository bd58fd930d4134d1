"""What a switch of the job costs, by default raytf's Prometheus series (output.metrics: each task records its
steps, examples, timing, loss and phase through ray.util.metrics, at most twice a second): the digits job's
steady-state examples/s with it on and off, interleaved per rep in one run (Ray started once, before any
timing, with the metrics export every second, its fastest, rather than Ray's default 10 s).

    python benchmarks/bench_metrics.py [--reps 5] [--epochs 3] [--steps-per-epoch 200] [--key output.metrics]

Reported: the median examples/s of each, on / off, and the raytf series the endpoints held afterwards.
The target: within run-to-run noise. `--key output.timing` measures the per-worker step timing (timestamps
inside each step), `--key train.deterministic` op determinism, the same way.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "digits.yaml"


def fit(key: str, on: bool, epochs: int, steps_per_epoch: int) -> float:
    import raytf

    # Longer epochs than the data's 22 steps (each worker re-reads its shard): steady state long enough that
    # run-to-run noise on a shared 2-core machine does not swamp a cost of a few percent.
    result = raytf.fit(str(JOB), {"train.epochs": epochs, "train.steps_per_epoch": steps_per_epoch,
                                  "output.dir": tempfile.mkdtemp(), "output.tensorboard": False, key: on})
    return result.examples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=200)
    parser.add_argument("--key", default="output.metrics", choices=["output.metrics", "output.timing",
                                                                    "train.deterministic"])
    args = parser.parse_args()
    import ray

    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # read by the raylet ray.init starts
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps):
        for on in (False, True) if rep % 2 == 0 else (True, False):  # alternate who goes first
            rates[on].append(fit(args.key, on, args.epochs, args.steps_per_epoch))
    time.sleep(2)  # one more export
    sys.path.insert(0, str(REPO))
    from tests.prometheus import scrape

    names = ("ray_raytf_steps_total", "ray_raytf_examples_total", "ray_raytf_input_wait_seconds_total",
             "ray_raytf_step_seconds_total", "ray_raytf_loss", "ray_raytf_task_phase", "ray_raytf_job_state",
             "ray_raytf_restarts_total")
    held = {name: len(scrape(name)) for name in names}
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    spread = max(statistics.pstdev(r) / statistics.mean(r) for r in rates.values())
    print(f"\n{args.key}, digits job, {args.epochs} epochs x {args.steps_per_epoch} steps, median of "
          f"{args.reps}:\n")
    print(f"| {args.key} | examples/s | reps |")
    print("|---|---:|---|")
    print(f"| off | {off:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[False])} |")
    print(f"| on | {on:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[True])} |")
    print(f"\non / off: {on / off:.3f} (run-to-run spread, the larger coefficient of variation: {spread:.1%})")
    print("series held by the endpoints afterwards: " + ", ".join(f"{k} {v}" for k, v in held.items()))
    ray.shutdown()


if __name__ == "__main__":
    main()
