"""Large global batches on the digits job, side by side in one run (Ray started once, before any timing):

1. What the schedule buys: global batch 1024 (16x the job's 64) with the learning rate scaled
   (optimizer.scale_lr, sqrt for Adam, linear for SGD) from a few base rates, constant vs linear warmup
   + cosine, same epochs; batch 64 at the smallest base rate as the reference. Reported: final validation
   accuracy and loss.
2. What accumulation costs: effective batch 1024 as K=1 x 1024 and as K=4 x 256 (the per-replica batch,
   and so memory, a quarter), same optimizer steps. Reported: steady-state examples/s and their ratio.

    python benchmarks/bench_large_batch.py [--epochs 100] [--reps 1] [--optimizer adam|sgd] [--rule sqrt|linear]
        [--base-lr 0.003 0.01 0.03] [--only schedule|accumulation] [--steps 100]

Medians over reps. Every run trains 2 workers on the embedded local Ray.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "digits.yaml"
BASE_BATCH = 64


def optimizer(name: str, base_lr: float, batch: int, schedule: dict, rule: str | None) -> dict:
    section = {"name": name, "learning_rate": base_lr, "schedule": schedule,
               "options": {"momentum": 0.9} if name == "sgd" else {}}
    if rule is not None:
        section["scale_lr"] = {"rule": rule, "base_batch_size": BASE_BATCH}
    return {"optimizer": section, "train.global_batch_size": batch}


def schedule_cases(epochs: int, name: str, rule: str, base_lrs: list[float]) -> dict[str, dict]:
    """The reference at batch 64 and the smallest rate; then, per base rate, batch 1024 with the rate
    scaled by `rule`, constant and with warmup + cosine."""
    warmup = max(1, epochs // 8)
    factor = 16 if rule == "linear" else 4
    cases = {f"batch {BASE_BATCH}, lr {base_lrs[0]}, constant (reference)":
             optimizer(name, base_lrs[0], BASE_BATCH, {"name": "constant"}, None)}
    for lr in base_lrs:
        cases[f"batch 1024, lr {lr} x{factor}, constant"] = optimizer(name, lr, 1024, {"name": "constant"}, rule)
        cases[f"batch 1024, lr {lr} x{factor}, warmup {warmup} epochs + cosine"] = optimizer(
            name, lr, 1024, {"name": "cosine", "warmup": {"epochs": warmup}}, rule)
    return cases


ACCUMULATION_CASES = {
    "K=1 x 1024": {"train.global_batch_size": 1024, "train.accumulation_steps": 1},
    "K=4 x 256": {"train.global_batch_size": 256, "train.accumulation_steps": 4},
}


def fit(overrides: dict):
    import raytf

    return raytf.fit(str(JOB), {"output.dir": tempfile.mkdtemp(), "output.tensorboard": False, **overrides},
                     verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam", help="sgd: with momentum 0.9")
    parser.add_argument("--rule", choices=["linear", "sqrt"], default="sqrt")
    parser.add_argument("--base-lr", type=float, nargs="+", default=[0.003, 0.01, 0.03],
                        help="rates at batch 64 (scaled by the rule at 1024)")
    parser.add_argument("--only", choices=["schedule", "accumulation"], help="run one of the two comparisons")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of each accumulation run")
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cases = {} if args.only == "accumulation" else schedule_cases(args.epochs, args.optimizer, args.rule, args.base_lr)
    accuracy: dict[str, list[float]] = {name: [] for name in cases}
    loss: dict[str, list[float]] = {name: [] for name in cases}
    rate: dict[str, list[float]] = {name: [] for name in ACCUMULATION_CASES}
    for _ in range(args.reps):  # interleaved, so drift on the machine hits every case alike
        for name, overrides in cases.items():
            result = fit({"train.epochs": args.epochs, **overrides})
            accuracy[name].append(result.final["val_accuracy"])
            loss[name].append(result.final["val_loss"])
        for name, overrides in ({} if args.only == "schedule" else ACCUMULATION_CASES).items():
            # optimizer steps of 1024 examples, no validation: the steps alone
            result = fit({"train.epochs": 1, "train.steps_per_epoch": args.steps, "data.validation": None,
                          **overrides})
            rate[name].append(result.examples_per_s)
    if cases:
        print(f"\nWhat the schedule buys ({args.epochs} epochs, {args.optimizer}, {args.rule} scaling from "
              f"batch {BASE_BATCH}; median of {args.reps}):\n")
        print("| run | final val accuracy | final val loss |")
        print("|---|---:|---:|")
        for name in cases:
            print(f"| {name} | {statistics.median(accuracy[name]):.4f} | {statistics.median(loss[name]):.4f} |")
    if args.only == "schedule":
        return ray.shutdown()
    print(f"\nWhat accumulation costs (effective batch 1024, {args.steps} optimizer steps, median of {args.reps}):\n")
    print("| run | examples/s | vs K=1 |")
    print("|---|---:|---:|")
    base = statistics.median(rate["K=1 x 1024"])
    for name in ACCUMULATION_CASES:
        value = statistics.median(rate[name])
        print(f"| {name} | {value:.0f} | {value / base:.2f}x |")
    ray.shutdown()


if __name__ == "__main__":
    main()
