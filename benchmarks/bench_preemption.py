"""A drained node against a killed node, side by side in one run: the same 2-worker digits job (global batch
16, 89 steps per epoch, 5 epochs, a checkpoint every 40 steps) on a local cluster of 1-CPU `spot` nodes;
at step AT (mid-epoch 2), worker rank 1's node is either drained through Ray's GCS with a 30-s deadline (what
a spot reclaim or `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` does) or removed outright (the same
node killed with no notice). max_restarts 3, no warm standbys (the drained run places anew; the same for
both). Measured per run: steps lost (steps trained again after the restart), recovery
time (training stopped -> the first training step of the next attempt: for the kill, from the kill; for the
drain, from the checkpoint at the common step, the steps before it having been trained), the drain's notice
-> checkpoint time, and total wall time. A preemption is not
charged to failure.max_restarts; the kill is (max_restarts 1).

    python benchmarks/bench_preemption.py [--reps 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
AT = 150  # mid-epoch 2, 30 steps after the checkpoint at 120
EPOCHS = 5
BATCH = 16
INTERVAL = 40


def job_file(work: Path, name: str) -> Path:
    spec = yaml.safe_load((REPO / "jobs" / "digits.yaml").read_text())
    spec.update(name=name, train={"epochs": EPOCHS, "global_batch_size": BATCH, "seed": 0},
                cluster={"workers": 2, "cpus_per_worker": 1, "resources_per_worker": {"spot": 1}, "reserve_timeout_s": 60},
                checkpoint={"dir": str(work / name / "ckpt"), "every_steps": INTERVAL, "keep": 2},
                failure={"max_restarts": 3, "hang_timeout_s": 60, "standby": False},
                output={"dir": str(work / name / "out"), "tensorboard": False})
    path = REPO / "jobs" / f".bench-preemption-{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def one_run(cluster, how: str, work: Path) -> dict:
    import ray

    from raytf.driver.controller import run
    from raytf.job import load
    from tests.faults import AtSteps, drain

    spot = [n for n in cluster.worker_nodes if n.node_id in _spot_ids]
    by_id = {n.node_id: n for n in spot}

    def event(group):
        node = group.tasks[1].node_id
        if how == "drained":
            drain(node, deadline_s=30)
        else:  # everything on the node dies at once: its TF process first (a node's teardown takes seconds)
            ray.kill(group._by_rank[1], no_restart=True)
            cluster.remove_node(by_id[node], allow_graceful=False)

    trigger = AtSteps([(AT, event)])
    path = job_file(work, how)
    started = time.time()
    try:
        result = run(load(path), group_cls=trigger.group_cls)
    finally:
        path.unlink()
    (_, seen_step, at), = trigger.done
    restart, last = result.restarts[0], result.restarts[-1]  # a restart may itself fail to start (a killed node)
    return {"how": how, "event_step": seen_step, "resumed_from": last["resumed_from_step"],
            # killed: the furthest step trained (the node may take a moment to go) less the step resumed from
            "steps_lost": (max(seen_step, restart["last_step"]) - last["resumed_from_step"] if how == "killed"
                           else restart["steps_lost"]),
            "step_at_notice": restart.get("step_at_notice"), "stop_step": restart.get("stop_step"),
            # training stopped: at the kill; for the drain, once the checkpoint at the common step was written
            # (the steps between notice and stop were trained, not lost)
            "notice_to_checkpoint_s": restart.get("notice_to_checkpoint_s"), "checkpoint_s": restart.get("checkpoint_s"),
            # from the drain itself (raytf's own figure starts when it saw it): when raytf saw it is the deadline
            # less the seconds it had left then
            "drain_to_checkpoint_s": (round(restart["deadline"] - restart["deadline_s_after_notice"]
                                            + restart["notice_to_checkpoint_s"] - at, 3)
                                      if how == "drained" and restart.get("notice_to_checkpoint_s") is not None else None),
            "recovery_s": round(last["first_step_at"] - (restart["time"] if how == "drained" else at), 2),
            "wall_s": round(time.time() - started, 1),
            "kind": restart["kind"], "restarts": len(result.restarts), "charged": how == "killed",
            "why": [f"{r['kind']}: {r['reason'][:160]}" for r in result.restarts]}


_spot_ids: set[str] = set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--only", choices=["drained", "killed"], default=None)
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                for how in [args.only] if args.only else ("drained", "killed"):  # fresh nodes each: three, one goes
                    for n in [cluster.add_node(num_cpus=1, resources={"spot": 1}) for _ in range(3)]:
                        _spot_ids.add(n.node_id)
                    cluster.wait_for_nodes()
                    rows.append(one_run(cluster, how, Path(tmp) / f"{rep}"))
                    print(rows[-1], flush=True)
                    for n in list(cluster.worker_nodes):
                        cluster.remove_node(n, allow_graceful=False)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("\n| node | steps lost (median) | recovery s (median) | drain -> checkpoint s (raytf's notice ->) | wall s (median) | restarts | "
          "first restart's kind | charged |")
    print("|---|---|---|---|---|---|---|---|")
    for how in sorted({r["how"] for r in rows}):
        mine = [r for r in rows if r["how"] == how]
        med = lambda key: statistics.median(r[key] for r in mine)  # noqa: E731
        safe = f"{med('drain_to_checkpoint_s'):.2f} ({med('notice_to_checkpoint_s'):.2f})" if how == "drained" else "-"
        print(f"| {how} at step ~{AT} | {med('steps_lost'):g} | {med('recovery_s'):.1f} | {safe} | {med('wall_s'):.1f} | "
              f"{', '.join(str(r['restarts']) for r in mine)} | {mine[0]['kind']} | {'yes' if mine[0]['charged'] else 'no'} |")


if __name__ == "__main__":
    main()
