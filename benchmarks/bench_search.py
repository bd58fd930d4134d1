"""Three ways to search the same space at an equal budget of trial-epochs, side by side in one run:
grid + ASHA, Optuna + ASHA, and population-based training, each trial a 2-worker raytf job.

    pip install -e '.[tune-search]' && python benchmarks/bench_search.py [--budget 32] [--target 0.12]

The problem: the digits MLP (jobs/digits-search.yaml), where the learning rate matters: over
loguniform [1e-4, 1e-1] the final val_loss spans more than an order of magnitude. Space: learning rate x
global batch {32, 64, 128}. Budget B trial-epochs: grid and Optuna run B/4 trials of 4 epochs (ASHA may stop
some, so they spend at most B); pbt runs a population of 4 for B/4 epochs, perturbing every 2.
The grid is lr {1e-4, 1e-3, 1e-2, 1e-1} x batch {32, 64} (8 points at B=32).

Reported per way: the best final val_loss, the best val_loss any epoch reached, the trial-epochs spent,
wall time, and the time from the sweep's start until some trial first reported val_loss <= target (Tune's own
per-epoch timestamps), as a markdown table.
"""
from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWEEP = REPO / "jobs" / "digits-search.yaml"
LR = {"loguniform": [0.0001, 0.1]}
BATCH = {"choice": [32, 64, 128]}


def ways(budget: int) -> dict[str, dict]:
    trials = budget // 4
    lrs = [0.0001, 0.001, 0.01, 0.1]
    batches = [32, 64][: max(1, trials // len(lrs))]
    asha = {"name": "asha", "grace_period": 1, "reduction_factor": 2}
    return {
        "grid + ASHA": {"train.epochs": 4, "tune.search": {"algorithm": "grid"}, "tune.scheduler": asha,
                        "tune.num_samples": 1,
                        "tune.space.optimizer.learning_rate": {"grid": lrs},
                        "tune.space.train.global_batch_size": {"grid": batches}},
        "Optuna + ASHA": {"train.epochs": 4, "tune.search": {"algorithm": "optuna"}, "tune.scheduler": asha,
                          "tune.num_samples": trials, "tune.space.optimizer.learning_rate": LR,
                          "tune.space.train.global_batch_size": BATCH},
        "PBT": {"train.epochs": budget // 4, "tune.search": {"algorithm": "grid"},
                "tune.scheduler": {"name": "pbt", "perturbation_interval": 2}, "tune.num_samples": 4,
                "tune.space.optimizer.learning_rate": LR, "tune.space.train.global_batch_size": BATCH},
    }


def first_time_under(experiment: Path, target: float, started: float) -> float | None:
    """Seconds from the sweep's start until any trial first reported val_loss <= target (Tune's progress.csv)."""
    times = []
    for progress in experiment.glob("*/progress.csv"):
        for row in csv.DictReader(open(progress)):
            if row.get("val_loss") and float(row["val_loss"]) <= target:
                times.append(float(row["timestamp"]))
    return min(times) - started if times else None


def run_way(name: str, overrides: dict, target: float) -> dict:
    import raytf

    out = tempfile.mkdtemp(prefix="bench-search-")
    # tune.search replaced whole: the example's points_to_evaluate (a head start) are left out
    settings = {"output.dir": out, "output.tensorboard": False, "tune.lr_scaling": {"rule": "none"},
                "tune.max_concurrent_trials": "auto", "tune.seed": 0, **overrides}
    started = time.time()
    result = raytf.tune(str(SWEEP), settings)
    wall = time.time() - started
    spent = sum(r["epochs"] for r in result.rows)
    finals = [r["final"] for r in result.rows if r["status"] == "completed" and r["final"] is not None]
    bests = [r["best"] for r in result.rows if r["best"] is not None]
    return {"way": name, "trials": len(result.rows), "trial_epochs": spent,
            "best_final": min(finals, default=float("nan")), "best_any_epoch": min(bests, default=float("nan")),
            "wall_s": wall,
            "to_target_s": first_time_under(Path(out) / "tune", target, started)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=32, help="trial-epochs per way (a multiple of 4)")
    parser.add_argument("--target", type=float, default=0.12, help="val_loss for the time-to-target column")
    args = parser.parse_args()
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="ERROR")  # never a stale cluster
    rows = [run_way(name, overrides, args.target) for name, overrides in ways(args.budget).items()]
    ray.shutdown()
    print(f"\nbudget {args.budget} trial-epochs per way; target val_loss {args.target}\n")
    print("| way | trials | trial-epochs spent | best final val_loss | best val_loss any epoch | wall (s) | "
          f"time to val_loss <= {args.target} (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        to_target = "not reached" if r["to_target_s"] is None else f"{r['to_target_s']:.1f}"
        print(f"| {r['way']} | {r['trials']} | {r['trial_epochs']} | {r['best_final']:.4f} | "
              f"{r['best_any_epoch']:.4f} | {r['wall_s']:.1f} | {to_target} |")


if __name__ == "__main__":
    main()
