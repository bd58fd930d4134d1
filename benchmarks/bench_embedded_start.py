"""`raytf run jobs/digits.yaml` on an embedded Ray, side by side in one run: today's embedded Ray, whose node
prestarts no idle Python workers (`raytf.driver.session.EMBEDDED_RAY_CONFIG`), against Ray's default (one idle
worker per CPU started when the driver connects, none of which a raytf actor can use: they all carry a runtime
env). Interleaved per rep, each in a fresh copy of jobs/; the wall seconds and the whole machine's busy
CPU-seconds meanwhile (/proc/stat: Ray's daemons and workers are not the command's children).

    python benchmarks/bench_embedded_start.py [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = "from raytf.cli import main; main()"
WAYS = {
    "no prestarted workers (today)": RUN,
    "Ray's default prestart (before)": "import raytf.driver.session as s; s.EMBEDDED_RAY_CONFIG.clear(); " + RUN,
}


def busy_core_s() -> float:
    fields = open("/proc/stat").readline().split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def one_run(code: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(REPO / "jobs", Path(tmp) / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
        busy, start = busy_core_s(), time.monotonic()
        subprocess.run([sys.executable, "-c", code, "run", "jobs/digits.yaml"], cwd=tmp, check=True,
                       capture_output=True)
        return time.monotonic() - start, busy_core_s() - busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    one_run(RUN)  # warm-up: the file cache
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in WAYS}
    for _ in range(args.reps):
        for name, code in WAYS.items():
            runs[name].append(one_run(code))
    base_wall = statistics.median(w for w, _ in runs["Ray's default prestart (before)"])
    base_busy = statistics.median(b for _, b in runs["Ray's default prestart (before)"])
    print("| embedded Ray | wall s (median) | vs before | busy core-s (median) | vs before |")
    print("|---|---:|---:|---:|---:|")
    for name, values in runs.items():
        wall, busy = statistics.median(w for w, _ in values), statistics.median(b for _, b in values)
        print(f"| {name} | {wall:.1f} | {wall / base_wall:.2f}x | {busy:.1f} | {busy / base_busy:.2f}x |")


if __name__ == "__main__":
    main()
