"""What the per-worker timing costs (output.timing: each worker's input wait and step time, measured with
timestamps inside its steps): the digits job's steady-state examples/s with it on and off, interleaved
per rep in one run (Ray started once, before any timing).

    python benchmarks/bench_timing.py [--reps 5] [--epochs 5]

Reported: the median examples/s of each, and on / off. The target is a cost under 2%.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "digits.yaml"


def fit(timing: bool, epochs: int) -> float:
    import raytf

    result = raytf.fit(str(JOB), {"train.epochs": epochs, "output.dir": tempfile.mkdtemp(),
                                  "output.tensorboard": False, "output.timing": timing})
    return result.examples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps):
        for timing in (False, True) if rep % 2 == 0 else (True, False):  # alternate who goes first
            rates[timing].append(fit(timing, args.epochs))
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"\nPer-worker timing, digits job, {args.epochs} epochs, median of {args.reps}:\n")
    print("| output.timing | examples/s | reps |")
    print("|---|---:|---|")
    print(f"| off | {off:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[False])} |")
    print(f"| on | {on:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[True])} |")
    print(f"\non / off: {on / off:.3f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
