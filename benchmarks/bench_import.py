"""What a TensorFlow process's start costs with the ml_dtypes raytf pins (<0.7) against 0.7.0, side by side in one
run: the CPU seconds (user + system) of `python -c "import tensorflow"`, the import every task actor, standby
and driver pays, interleaved per rep. 0.7.0 is installed into a temporary folder put first on PYTHONPATH (from
the package registry), so both runs share everything else.

    python benchmarks/bench_import.py [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile

SLOW = "0.7.0"


def import_cpu_s(pythonpath: str | None) -> tuple[float, str]:
    """CPU seconds of one fresh `import tensorflow`, and the ml_dtypes version it loaded."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", "import tensorflow, ml_dtypes; print(ml_dtypes.__version__)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as slow:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", slow,
                        f"ml_dtypes=={SLOW}"], check=True)
        runs: dict[str, list[float]] = {"pinned": [], SLOW: []}
        versions = {}
        for _ in range(args.reps):
            for name, path in (("pinned", None), (SLOW, slow)):
                cpu, versions[name] = import_cpu_s(path)
                runs[name].append(cpu)
    pinned = statistics.median(runs["pinned"])
    print("| ml_dtypes | import tensorflow, CPU s (median) | vs pinned |")
    print("|---|---:|---:|")
    for name, values in runs.items():
        med = statistics.median(values)
        label = f"{versions[name]} (pinned)" if name == "pinned" else versions[name]
        print(f"| {label} | {med:.2f} | {med / pinned:.2f}x |")


if __name__ == "__main__":
    main()
