"""Who is slow, and what it costs: each worker's input wait and step time (measured inside its steps)
against the others'. Pure.

Under MultiWorkerMirrored every step ends in an all-reduce, so every worker waits for the slowest: a
worker whose input is slow shows a long input wait, and its peers a long step time (they wait for it in
the all-reduce), so only input wait can name a worker there, and what it costs is the extra wait itself,
paid by the whole job. Under parameter servers workers step on their own: a slow worker shows a long
step time or input wait per step, and costs the job the share of one worker's throughput it does not
deliver.
"""
from __future__ import annotations

import statistics
from typing import Any

STANDS_OUT = 1.5  # x the median of the other workers
MIN_COST = 0.05  # and it must cost the job at least 5% of its training time (or throughput)
MIN_EXCESS_S = 0.5  # and at least this many seconds in all: a few steps' jitter names nobody


def find(workers: list[dict[str, Any]], train_s: float | None, synchronous: bool) -> list[dict[str, Any]]:
    """`workers`: per worker {rank, node_ip, input_wait_s, step_s, timed_steps}; returns the stragglers
    [{rank, node, what, seconds, typical_s, cost}], cost a fraction of the job's time (synchronous) or
    throughput (not); `what`: input_wait_s or step_s, whichever is further above the others'."""
    timed = [w for w in workers if w.get("timed_steps")]
    if len(timed) < 2 or not train_s:
        return []
    found = []
    for worker in timed:
        others = [w for w in timed if w is not worker]
        wait, typical_wait = _per_step(worker, others, "input_wait_s")
        if synchronous:  # only input wait is a worker's own; every worker waited for it, every step
            what, mine, typical = "input_wait_s", wait, typical_wait
            cost = (mine - typical) * worker["timed_steps"] / train_s
        else:  # one worker of n delivers less
            step, typical_step = _per_step(worker, others, "step_s")
            mine, typical = wait + step, typical_wait + typical_step
            what = "input_wait_s" if wait - typical_wait > step - typical_step else "step_s"
            cost = (1 - typical / mine) / len(timed) if mine > 0 else 0.0
        excess_s = (mine - typical) * worker["timed_steps"]
        if mine > STANDS_OUT * typical and cost >= MIN_COST and excess_s >= MIN_EXCESS_S:
            part_mine, part_typical = _per_step(worker, others, what)
            found.append({"rank": worker["rank"], "node": worker.get("node_ip"), "what": what,
                          "seconds": round(worker[what], 3), "typical_s": round(part_typical * worker["timed_steps"], 3),
                          "cost": round(cost, 3)})
    return found


def _per_step(worker: dict[str, Any], others: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """The worker's `key` per step, and the median of the others'."""
    return worker[key] / worker["timed_steps"], statistics.median(w[key] / w["timed_steps"] for w in others)


def describe(straggler: dict[str, Any], synchronous: bool) -> str:
    what = "input wait" if straggler["what"] == "input_wait_s" else "step time"
    cost = (f"~{straggler['cost']:.0%} of the training time (every worker waits for it in the all-reduce)"
            if synchronous else f"~{straggler['cost']:.0%} of the job's throughput")
    return (f"rank {straggler['rank']} on {straggler['node']} is slow: {what} {straggler['seconds']:.2f} s against "
            f"{straggler['typical_s']:.2f} s for the others; it costs {cost}")
