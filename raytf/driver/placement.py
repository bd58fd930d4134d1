"""One placement group per attempt, one bundle per TF task; a clear error when the cluster cannot hold it."""
from __future__ import annotations

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)

from raytf import backends
from raytf.backends.base import worker_bundle
from raytf.errors import PlacementTimeout
from raytf.spec import ClusterSpec, JobSpec
from raytf.sweep_capacity import place  # the same rules as a sweep's max_concurrent_trials: auto


def worker_bundles(cluster: ClusterSpec) -> list[dict[str, float]]:
    """One bundle per worker."""
    return [worker_bundle(cluster) for _ in range(cluster.workers)]


def bundle_roles(spec: JobSpec) -> list[str]:
    """The TF role of each bundle, in bundle order, as the job's strategy backend lays them out."""
    return backends.get(spec.strategy).roles(spec)


def job_bundles(spec: JobSpec) -> list[dict[str, float]]:
    """One bundle per TF task, in bundle_roles order."""
    return backends.get(spec.strategy).bundles(spec)


def total(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0) + v
    return out


def _fmt(resources: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU") if k in resources] + sorted(k for k in resources if k not in ("CPU", "GPU")
                                                                   and not k.startswith(("node:", "memory", "object_store")))
    return "{" + ", ".join(f"{k}: {resources[k]:g}" for k in keys) + "}"


def can_ever_hold(nodes: list[dict[str, float]], bundles: list[dict[str, float]], strategy: str) -> bool:
    """Pure: whether nodes with these total resources, all free, could hold the bundles under the placement
    strategy (each bundle on one node; PACK and SPREAD may share nodes, STRICT_PACK needs one node for all,
    STRICT_SPREAD a node per bundle)."""
    return place([dict(n) for n in nodes], [dict(b) for b in bundles], strategy)


def shortage_message(bundles: list[dict[str, float]], strategy: str, timeout_s: float,
                     cluster_total: dict[str, float], cluster_available: dict[str, float],
                     nodes: list[dict[str, float]], embedded: bool = False) -> str:
    """Pure: what was asked, what the cluster has, and what to change. `embedded`: the cluster is an
    embedded local Ray, which cannot grow, and the request was answered at once, without waiting."""
    asked = total(bundles)
    short = [k for k, v in asked.items() if cluster_total.get(k, 0) < v]
    largest = {k: max(b.get(k, 0) for b in bundles) for k in asked}
    biggest_fit = [k for k, v in largest.items() if all(n.get(k, 0) < v for n in nodes)] if nodes else []
    kinds = list(dict.fromkeys(_fmt(b) for b in bundles))
    if len(kinds) <= 1:
        shapes = f"{len(bundles)} bundles of {kinds[0] if kinds else '{}'} (total"
    else:
        shapes = f"{len(bundles)} bundles (" + ", ".join(f"{sum(1 for b in bundles if _fmt(b) == k)} x {k}"
                                                         for k in kinds) + "; total"
    opening = ("the embedded local Ray (this machine only; it cannot grow) can never hold the placement group"
               if embedded else f"placement group not ready after {timeout_s:g}s")
    msg = (f"{opening}: asked for {shapes} {_fmt(asked)}, strategy "
           f"{strategy}); the cluster has {_fmt(cluster_total)} in "
           f"{len(nodes)} node(s), {_fmt(cluster_available)} available now.")
    hints = []
    if short:
        grow = ("or run on a Ray cluster that has them (--address)" if embedded else
                "or add nodes (an autoscaling cluster may need a longer cluster.reserve_timeout_s)")
        hints.append(f"It lacks {', '.join(short)}: lower cluster.workers or the per-worker resources, {grow}.")
    if biggest_fit:
        hints.append(f"No single node has the {', '.join(biggest_fit)} one bundle needs: lower the per-worker resources.")
    if not hints and strategy.startswith("STRICT") and not can_ever_hold(nodes, bundles, strategy):
        hints.append(f"{strategy} cannot be met by these nodes: use placement: pack or spread.")
    if not hints:
        hints.append("The resources are busy with other work: wait, or raise cluster.reserve_timeout_s.")
    msg += " " + " ".join(hints)
    return msg


def reserve(bundles: list[dict[str, float]], placement: str, timeout_s: float, name: str = "") -> PlacementGroup:
    """Create the group and wait for it; on timeout remove it and raise PlacementTimeout. On an embedded
    local Ray (raytf.driver.session), which cannot grow, a group its node can never hold is a
    PlacementTimeout at once; a real cluster may gain nodes meanwhile (an autoscaler), so there raytf waits."""
    from raytf.driver import session

    strategy = placement.upper()
    if session.embedded():
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        if not can_ever_hold(nodes, bundles, strategy):
            raise PlacementTimeout(shortage_message(bundles, strategy, timeout_s, ray.cluster_resources(),
                                                    ray.available_resources(), nodes, embedded=True))
    pg = placement_group(bundles, strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        return pg
    remove_placement_group(pg)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    raise PlacementTimeout(shortage_message(bundles, strategy, timeout_s, ray.cluster_resources(),
                                            ray.available_resources(), nodes))


def release(pg: PlacementGroup | None) -> None:
    from raytf.driver.session import embedded_ray_gone

    if pg is None or embedded_ray_gone():  # an embedded Ray stopped by the same signal: nothing left to free
        return
    try:
        remove_placement_group(pg)
    except Exception:  # already gone, or Ray is shutting down: nothing left to free
        pass
