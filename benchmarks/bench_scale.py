"""raytf's own work per job at scale, on paper: a simulated 64-node x 8-GPU cluster (512 ranks), no Ray, no
TensorFlow. Times the pure parts the driver runs for one attempt (the placement's rank plan and actor names,
rank assignment from the actors' reports, every task's TF_CONFIG, the placement-shortage message, sweep
admission) and the controller stepping a whole 512-rank attempt (placing -> starting -> running -> done)
against the in-memory worker group of tests/fakes.py on a fake clock, for mirrored (one GPU per worker) and
parameter servers (a chief, 16 ps, 495 workers). Target: the rendezvous plan for 512 ranks under 1 s.

    python benchmarks/bench_scale.py [--nodes 64] [--gpus 8] [--reps 5] [--ray]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from raytf import backends, sweep_capacity  # noqa: E402
from raytf.driver import placement  # noqa: E402
from raytf.rendezvous import ActorLocation, tf_config, tf_configs  # noqa: E402
from raytf.job import Job, parse  # noqa: E402
from tests.conftest import base_spec  # noqa: E402


def timed(fn, reps: int) -> tuple[float, object]:
    """Median milliseconds of `reps` calls, and the last result."""
    times, out = [], None
    for _ in range(reps):
        started = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), out


def specs(ranks: int):
    mirrored = parse(base_spec(name="scale", train={"epochs": 1, "global_batch_size": ranks * 32, "seed": 0},
                               cluster={"workers": ranks, "cpus_per_worker": 4, "gpus_per_worker": 1,
                                        "reserve_timeout_s": 600}))
    ps = parse(base_spec(name="scale-ps", strategy="parameter_server",
                         train={"epochs": 1, "global_batch_size": (ranks - 17) * 32, "seed": 0},
                         cluster={"workers": ranks - 17, "ps": 16, "cpus_per_worker": 4, "gpus_per_worker": 1,
                                  "cpus_per_ps": 4, "cpus_per_chief": 4, "reserve_timeout_s": 600}))
    return {"mirrored": mirrored, "parameter_server": ps}


def placement_of(bundles: int, nodes: int, gpus: int, seed: int = 0) -> dict[int, str]:
    """bundle index -> node id as Ray might place them: gpus bundles per node, nodes in no particular order."""
    order = list(range(nodes))
    random.Random(seed).shuffle(order)
    return {i: f"{order[i // gpus]:056x}" for i in range(bundles)}


def reports_of(bundle_nodes: dict[int, str], nodes: int) -> list[ActorLocation]:
    ip = {node: f"10.{i // 256}.{i % 256}.10" for i, node in enumerate(sorted(set(bundle_nodes.values())))}
    return [ActorLocation(bundle_index=i, node_id=n, node_ip=ip[n], port=20000 + i, gpu_ids=(str(i % 8),))
            for i, n in bundle_nodes.items()]


def rendezvous_rows(spec, nodes: int, gpus: int, reps: int) -> list[tuple[str, float, str]]:
    backend = backends.get(spec.strategy)
    bundles = backend.bundles(spec)
    bundle_nodes = placement_of(len(bundles), nodes, gpus)
    reports = reports_of(bundle_nodes, nodes)
    plan_ms, names = timed(lambda: backend.actor_names(spec, bundle_nodes), reps)
    assign_ms, tasks = timed(lambda: backend.assign(reports, spec), reps)
    config_ms, configs = timed(lambda: tf_configs(tasks), reps)
    per_task_ms, _ = timed(lambda: [tf_config(tasks, t) for t in tasks], 1)  # built per task, as before
    assert len(set(names.values())) == len(bundles) and len({t.address for t in tasks}) == len(bundles)
    kib = sum(len(c) for c in configs) / 1024
    return [("plan ranks + actor names from the placement", plan_ms, f"{len(names)} names"),
            ("assign ranks from the actors' reports", assign_ms, f"{len(tasks)} tasks"),
            ("TF_CONFIG for every task", config_ms, f"{kib:,.0f} KiB in all ({kib / len(configs):.1f} KiB each); "
                                                    f"{per_task_ms:,.0f} ms built per task"),
            ("= the rendezvous plan", plan_ms + assign_ms + config_ms, "target < 1000 ms")]


def admission_rows(spec, nodes: int, gpus: int, reps: int) -> list[tuple[str, float, str]]:
    backend = backends.get(spec.strategy)
    bundles = backend.bundles(spec)
    cluster_nodes = [{"CPU": 4.0 * gpus, "GPU": float(gpus)} for _ in range(nodes)]
    too_many = bundles + [bundles[-1]] * gpus  # one node's worth more than the cluster has
    total = placement.total([dict(n) for n in cluster_nodes])
    short_ms, message = timed(lambda: placement.shortage_message(too_many, "PACK", 600, total, total, cluster_nodes),
                              reps)
    quarter = backend.bundles(backend.with_workers(spec, spec.cluster.workers // 4)) if spec.strategy == "mirrored" \
        else bundles[: len(bundles) // 4]
    fit_ms, fit = timed(lambda: sweep_capacity.auto_concurrency(cluster_nodes, [(quarter, "PACK")], 16), reps)
    assert "It lacks CPU" in message and fit == 4, (message, fit)
    return [("placement-shortage message (8 bundles too many)", short_ms, f"{len(message)} characters"),
            ("sweep admission: trials of a quarter of the cluster", fit_ms, f"{fit} at once")]


def controller_row(spec, reps: int) -> tuple[str, float, str]:
    from raytf.driver.controller import DONE, Controller
    from tests.fakes import FakeClock, FakeResources, Script

    def one_attempt():
        with tempfile.TemporaryDirectory() as tmp:
            clock = FakeClock()
            world = FakeResources(clock, lambda attempt, task: Script(finish_after=30.0), nodes=3)
            job = Job(spec=spec.model_copy(update={"output": spec.output.model_copy(update={"dir": tmp})}),
                      job_dir=Path(tmp))
            controller = Controller(job, world, env={}, clock=clock)
            steps = 0
            while controller.state != DONE:
                controller.step()
                steps += 1
            return steps

    ms, steps = timed(one_attempt, reps)
    return ("controller: one whole attempt against the fake group", ms, f"{steps} controller steps (30 fake seconds)")


def ray_rows(bundles: int, actors: int) -> list[tuple[str, float, str]]:
    """What Ray itself takes on this machine: one placement group of `bundles` tiny bundles (one node), and
    `actors` bare actors (no TensorFlow) created at once until each has answered."""
    import ray

    ray.init(address="local", num_cpus=bundles, include_dashboard=False, logging_level="ERROR")
    try:
        started = time.perf_counter()
        pg = ray.util.placement_group([{"CPU": 0.5}] * bundles)
        ray.get(pg.ready(), timeout=300)
        pg_ms = (time.perf_counter() - started) * 1000
        ray.util.remove_placement_group(pg)

        @ray.remote(num_cpus=0)
        class Bare:
            def ping(self):
                return 1

        started = time.perf_counter()
        handles = [Bare.remote() for _ in range(actors)]
        ray.get([h.ping.remote() for h in handles], timeout=600)
        actor_s = time.perf_counter() - started
    finally:
        ray.shutdown()
    return [(f"Ray: a placement group of {bundles} bundles, ready", pg_ms, "one node"),
            (f"Ray: {actors} bare actors created and answering", actor_s * 1000,
             f"{actors / actor_s:.1f} actors/s on {os.cpu_count()} CPUs (a process each)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ray", action="store_true", help="also time Ray's placement group and actor start-up here")
    args = parser.parse_args()
    ranks = args.nodes * args.gpus
    print(f"{args.nodes} nodes x {args.gpus} GPUs = {ranks} ranks; median of {args.reps} reps, one CPU core of this machine\n")
    for name, spec in specs(ranks).items():
        rows = rendezvous_rows(spec, args.nodes, args.gpus, args.reps)
        rows += admission_rows(spec, args.nodes, args.gpus, args.reps)
        rows.append(controller_row(spec, args.reps))
        print(f"**{name}** ({spec.cluster.workers} workers" + (f", {spec.cluster.ps} ps, a chief" if spec.cluster.ps else "")
              + ")\n\n| step | ms | |\n|---|---:|---|")
        for what, ms, note in rows:
            print(f"| {what} | {ms:,.1f} | {note} |")
        print()
    if args.ray:
        print("**Ray on this machine**\n\n| step | ms | |\n|---|---:|---|")
        for what, ms, note in ray_rows(ranks, 32):
            print(f"| {what} | {ms:,.1f} | {note} |")


if __name__ == "__main__":
    main()
