"""`raytf run jobs/digits.yaml` (or `--command`, e.g. "tune jobs/digits-sweep.yaml") on an embedded Ray, side by
side in one run, each way interleaved per rep in a fresh copy of jobs/: the wall seconds and the whole machine's
busy CPU-seconds meanwhile (/proc/stat: Ray's daemons and workers are not the command's children).

- today: this checkout (its embedded Ray prestarts no idle Python workers, `EMBEDDED_RAY_CONFIG`; the task
  processes get the job's code from raytf, with no Ray runtime env: `raytf.driver.packaging.pack_code`);
- today with Ray's default prestart (one idle worker per CPU when the driver connects);
- with `--previous <checkout>`: that checkout's raytf (e.g. a clone of the previous head), the baseline.

    python benchmarks/bench_embedded_start.py [--reps 5] [--previous /path/to/previous/checkout] [--command "..."]
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


def busy_core_s() -> float:
    fields = open("/proc/stat").readline().split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def one_run(code: str, checkout: Path = REPO,
            command: tuple[str, ...] = ("run", "jobs/digits.yaml")) -> tuple[float, float]:
    # PYTHONPATH: the driver and (an embedded Ray's workers inherit it) the tasks import this checkout's raytf
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(REPO / "jobs", Path(tmp) / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
        busy, start = busy_core_s(), time.monotonic()
        subprocess.run([sys.executable, "-c", code, *command], cwd=tmp, check=True,
                       capture_output=True, env=env)
        return time.monotonic() - start, busy_core_s() - busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--previous", type=Path, help="another checkout of raytf: the baseline")
    parser.add_argument("--command", default="run jobs/digits.yaml",
                        help="the console script's arguments, from the folder that holds the copy of jobs/")
    args = parser.parse_args()
    command = tuple(args.command.split())
    ways = {"today": (RUN, REPO),
            "today, Ray's default prestart": ("import raytf.driver.session as s; s.EMBEDDED_RAY_CONFIG.clear(); " + RUN,
                                              REPO)}
    if args.previous:
        ways[f"previous ({args.previous.name})"] = (RUN, args.previous.resolve())
    baseline = list(ways)[-1]
    one_run(RUN)  # warm-up: the file cache
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.reps):
        for name, (code, checkout) in ways.items():
            runs[name].append(one_run(code, checkout, command))
    base_wall = statistics.median(w for w, _ in runs[baseline])
    base_busy = statistics.median(b for _, b in runs[baseline])
    print(f"`raytf {args.command}`, {args.reps} rep(s)\n")
    print(f"| embedded Ray | wall s (median) | vs {baseline} | busy core-s (median) | vs {baseline} |")
    print("|---|---:|---:|---:|---:|")
    for name, values in runs.items():
        wall, busy = statistics.median(w for w, _ in values), statistics.median(b for _, b in values)
        print(f"| {name} | {wall:.1f} | {wall / base_wall:.2f}x | {busy:.1f} | {busy / base_busy:.2f}x |")


if __name__ == "__main__":
    main()
