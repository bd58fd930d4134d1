"""How fast a bad job spec is answered: `raytf run` / `raytf tune` (the real console script, as a user runs
it) on specs with one mistake each, side by side with `python -c "import tensorflow"` in the same run,
interleaved per rep.

    python benchmarks/bench_badspec.py [--reps 5]

Two kinds of mistake: those whose check needs no TensorFlow (unknown key, wrong type, indivisible batch,
missing path, missing column, a sweep grid point that cannot run), which should exit 2 in well under half
an `import tensorflow`, and those that need Keras (loss, metric, optimizer names), which cannot be
faster than the import. Reported: median wall seconds per case, its ratio to the import, the exit code
and how many lines it printed on stderr.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
RAYTF = str(Path(sys.executable).parent / "raytf")

NO_TF = {
    "unknown key": ["run", "digits.yaml", "--set", "train.epoch=3"],
    "wrong type": ["run", "digits.yaml", "--set", "train.epochs=many"],
    "indivisible batch": ["run", "digits.yaml", "--set", "train.global_batch_size=65"],
    "missing path": ["run", "digits.yaml", "--set", "data.train=data/nothing.parquet"],
    "missing column": ["run", "digits.yaml", "--set", "data.label=digit"],
    "missing module": ["run", "digits.yaml", "--set", "model=digitz:build_model"],
    "bad sweep grid": ["tune", "digits-sweep.yaml", "--set", "tune.space.train.global_batch_size={grid: [64, 99]}"],
}
NEEDS_KERAS = {
    "unknown loss": ["run", "digits.yaml", "--set", "loss=nosuchloss"],
    "unknown metric": ["run", "digits.yaml", "--set", "metrics=[nosuchmetric]"],
    "unknown optimizer": ["run", "digits.yaml", "--set", "optimizer.name=nosuchopt"],
}
IMPORT_TF = "import tensorflow"


def timed(argv: list[str]) -> tuple[float, int, int]:
    """(wall seconds, exit code, lines on stderr) of one command, run from the job folder."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=JOBS, capture_output=True, text=True, env=env, timeout=120)
    return time.perf_counter() - started, proc.returncode, len(proc.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    cases = {IMPORT_TF: [sys.executable, "-c", "import tensorflow"],
             **{name: [RAYTF, *argv] for name, argv in {**NO_TF, **NEEDS_KERAS}.items()}}
    runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, argv in cases.items():
            runs[name].append(timed(argv))
    base = statistics.median(r[0] for r in runs[IMPORT_TF])
    print(f"| case | needs TF | exit | stderr lines | wall (s) | vs `{IMPORT_TF}` |")
    print("|---|---|---:|---:|---:|---:|")
    for name, results in runs.items():
        wall = statistics.median(r[0] for r in results)
        kind = "-" if name == IMPORT_TF else ("yes" if name in NEEDS_KERAS else "no")
        print(f"| {name} | {kind} | {results[-1][1]} | {results[-1][2]} | {wall:.2f} | {wall / base:.2f}x |")


if __name__ == "__main__":
    main()
