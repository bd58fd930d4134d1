"""What a raytf process's TensorFlow import costs, side by side in one run: a plain `import tensorflow`, the task
actor's first lean import (scikit-learn hidden from Keras), the previous head's raytf.tf_import (scikit-learn
and matplotlib hidden) and today's (IPython hidden too), each in a fresh process that has imported raytf first (as a task actor has), interleaved per
rep; the CPU seconds (user + system).

    python benchmarks/bench_worker_import.py [--reps 5]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

WAYS = {
    "plain `import tensorflow`": "import tensorflow",
    "scikit-learn hidden (the actor's import before)":
        "import sys; sys.modules['sklearn'] = None; import tensorflow; del sys.modules['sklearn']",
    "scikit-learn and matplotlib hidden (raytf.tf_import before)":
        "import sys; sys.modules['sklearn'] = sys.modules['matplotlib'] = None; import tensorflow; "
        "del sys.modules['sklearn'], sys.modules['matplotlib']",
    "raytf.tf_import (scikit-learn, matplotlib and IPython hidden)":
        "from raytf import tf_import; tf_import.import_tensorflow()",
}


def cpu_s(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # raytf first in each, as in a task actor (its package is loaded before TensorFlow is)
    subprocess.run([sys.executable, "-c", "import raytf; " + code + "; import keras"], check=True,
                   capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(args.reps):
        for name, code in WAYS.items():
            runs[name].append(cpu_s(code))
    base = statistics.median(runs["scikit-learn and matplotlib hidden (raytf.tf_import before)"])
    print("| import | CPU s (median) | vs raytf.tf_import before |")
    print("|---|---:|---:|")
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
