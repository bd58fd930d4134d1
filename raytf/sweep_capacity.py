"""How many of a sweep's trials the cluster holds at once: each trial's bundles placed on the nodes' free
resources the way Ray's placement strategies allow (`max_concurrent_trials: auto`, a trial that can never
fit), and a job's placement checked by the same rules (raytf.driver.placement). Pure: plain dicts of
resources; no Ray.
"""
from __future__ import annotations

from typing import Mapping


def _fits(free: dict[str, float], need: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _take(free: dict[str, float], need: Mapping[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def place(nodes: list[dict[str, float]], bundles: list[dict[str, float]], placement: str) -> bool:
    """Place one trial's bundles on the nodes' free resources (mutated only on success), the way Ray's
    placement strategies allow: PACK prefers one node, SPREAD prefers distinct nodes, STRICT_* insist."""
    placement = placement.upper()
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    if placement in ("PACK", "STRICT_PACK"):
        for node in nodes:
            if _fits(node, total):
                _take(node, total)
                return True
        if placement == "STRICT_PACK":
            return False
    trial = [dict(n) for n in nodes]
    used: set[int] = set()
    for bundle in bundles:
        order = [i for i in range(len(trial)) if i not in used]
        if placement != "STRICT_SPREAD":
            order += sorted(used)
        spot = next((i for i in order if _fits(trial[i], bundle)), None)
        if spot is None:
            return False
        _take(trial[spot], bundle)
        used.add(spot)
    for node, after in zip(nodes, trial):
        node.clear()
        node.update(after)
    return True


def trials_that_fit(nodes: list[Mapping[str, float]], bundles: list[dict[str, float]], strategy: str,
                    limit: int = 10_000) -> int:
    """How many copies of one trial (its bundles) the nodes hold at once."""
    free = [dict(n) for n in nodes]
    count = 0
    while count < limit and place(free, bundles, strategy):
        count += 1
    return count


def auto_concurrency(nodes: list[Mapping[str, float]], trials: list[tuple[list[dict[str, float]], str]],
                     num_trials: int) -> int:
    """`max_concurrent_trials: auto`: as many trials as the cluster holds of its largest trial shape, at
    most the number of trials. 0 means the largest trial does not fit the cluster at all.
    Tune reserves each trial's placement group whole, so trials never hold part of what another waits for;
    capping at what fits keeps Tune from queueing groups the cluster cannot give."""
    if not trials:
        return 0
    shapes = {(tuple(tuple(sorted(b.items())) for b in bundles), strategy) for bundles, strategy in trials}
    fit = min(trials_that_fit(nodes, [dict(b) for b in bundles], strategy, limit=num_trials)
              for bundles, strategy in shapes)
    return min(fit, num_trials)
