"""What the per-worker timing costs (output.timing: each worker's input wait and step time, measured with
timestamps inside its steps): the digits job's steady-state examples/s with it on and off, interleaved
per rep in one run (Ray started once, before any timing).

    python benchmarks/bench_timing.py [--reps 5] [--epochs 3] [--steps-per-epoch 200]

Reported: the median examples/s of each, and on / off. The target is a cost under 2%.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "digits.yaml"


def fit(timing: bool, epochs: int, steps_per_epoch: int) -> float:
    import raytf

    # Longer epochs than the data's 22 steps (each worker re-reads its shard): steady state long enough that
    # run-to-run noise on a shared 2-core machine does not swamp a cost of a few percent.
    result = raytf.fit(str(JOB), {"train.epochs": epochs, "train.steps_per_epoch": steps_per_epoch,
                                  "output.dir": tempfile.mkdtemp(), "output.tensorboard": False,
                                  "output.timing": timing})
    return result.examples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=200)
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps):
        for timing in (False, True) if rep % 2 == 0 else (True, False):  # alternate who goes first
            rates[timing].append(fit(timing, args.epochs, args.steps_per_epoch))
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"\nPer-worker timing, digits job, {args.epochs} epochs x {args.steps_per_epoch} steps, median of "
          f"{args.reps}:\n")
    print("| output.timing | examples/s | reps |")
    print("|---|---:|---|")
    print(f"| off | {off:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[False])} |")
    print(f"| on | {on:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[True])} |")
    print(f"\non / off: {on / off:.3f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
