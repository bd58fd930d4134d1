"""Rank assignment and TF_CONFIG: pure functions over where the actors are (ActorLocation). No Ray, no TensorFlow."""
from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class ActorLocation:
    """Where one started actor runs (its node, the port it holds, its GPUs), before ranks exist."""

    bundle_index: int
    node_id: str
    node_ip: str
    port: int
    gpu_ids: tuple[str, ...] = ()
    cuda_visible_devices: str | None = None


@dataclasses.dataclass(frozen=True)
class Task:
    """A placed TF task: the actor at `bundle_index` plays `role` number `index` with global `rank`."""

    rank: int
    role: str
    index: int
    bundle_index: int
    node_id: str
    node_ip: str
    port: int
    gpu_ids: tuple[str, ...]
    cuda_visible_devices: str | None = None

    @property
    def address(self) -> str:
        host = f"[{self.node_ip}]" if ":" in self.node_ip else self.node_ip
        return f"{host}:{self.port}"


def assign_ranks(locations: list[ActorLocation]) -> list[Task]:
    """Deterministic ranks: actors on one node get adjacent ranks; nodes are ordered by their lowest
    bundle index (so the chief's node comes first), actors within a node by bundle index. Rank 0 is the
    chief. The result is ordered by rank.

    Only the placement decides (which node holds which bundle), not what an actor finds once it runs (its
    GPU ids): so ranks, and the names actors are created with, are known before any actor exists. Each
    actor sees only its own GPUs, so their ids do not need to follow the ranks."""
    if not locations:
        raise ValueError("no actors to rank")
    bundles = [r.bundle_index for r in locations]
    if len(set(bundles)) != len(bundles):
        raise ValueError(f"duplicate bundle indexes in {sorted(bundles)}")
    first_bundle_on_node: dict[str, int] = {}
    for r in locations:
        first_bundle_on_node[r.node_id] = min(first_bundle_on_node.get(r.node_id, r.bundle_index), r.bundle_index)
    ordered = sorted(locations, key=lambda r: (first_bundle_on_node[r.node_id], r.bundle_index))
    return [Task(rank=i, role="worker", index=i, bundle_index=r.bundle_index, node_id=r.node_id,
                 node_ip=r.node_ip, port=r.port, gpu_ids=tuple(r.gpu_ids),
                 cuda_visible_devices=r.cuda_visible_devices) for i, r in enumerate(ordered)]


def placed(bundle_nodes: dict[int, str]) -> list[ActorLocation]:
    """Stand-ins for the locations of actors not yet created, from the placement alone (bundle index ->
    node id): enough to assign ranks and roles, and so to name the actors at creation."""
    return [ActorLocation(bundle_index=i, node_id=node, node_ip="", port=0) for i, node in sorted(bundle_nodes.items())]


def assign_roles(locations: list[ActorLocation], roles: list[str]) -> list[Task]:
    """Parameter-server tasks: the actor in bundle i plays roles[i] (chief, ps, worker or evaluator);
    its index counts that role's bundles before it. Ranks follow bundle order, so the chief is rank 0.
    The result is ordered by rank."""
    by_bundle = {r.bundle_index: r for r in locations}
    if sorted(by_bundle) != list(range(len(roles))) or len(locations) != len(roles):
        raise ValueError(f"bundle indexes {sorted(r.bundle_index for r in locations)} do not match the "
                         f"{len(roles)} roles")
    if roles.count("chief") != 1 or roles[0] != "chief":
        raise ValueError(f"the first bundle must be the one chief, got roles {roles}")
    seen: dict[str, int] = {}
    tasks = []
    for bundle, role in enumerate(roles):
        r = by_bundle[bundle]
        index = seen.get(role, 0)
        seen[role] = index + 1
        tasks.append(Task(rank=bundle, role=role, index=index, bundle_index=bundle, node_id=r.node_id,
                          node_ip=r.node_ip, port=r.port, gpu_ids=tuple(r.gpu_ids),
                          cuda_visible_devices=r.cuda_visible_devices))
    return tasks


def task_name(job: str, task: Task) -> str:
    """How a task shows in Ray (`ray list actors`, `ray list tasks`, the dashboard, log lines):
    raytf:<job>:<role>-<index>, e.g. raytf:digits:worker-1."""
    return f"raytf:{job}:{task.role}-{task.index}"


def cluster_spec(tasks: list[Task]) -> dict[str, list[str]]:
    """{role: [address by index]} as TF's ClusterSpec wants it. The evaluator is not part of TF's
    cluster: it only reads checkpoints."""
    roles: dict[str, dict[int, str]] = {}
    for t in tasks:
        if t.role == "evaluator":
            continue
        slot = roles.setdefault(t.role, {})
        if t.index in slot:
            raise ValueError(f"two tasks claim {t.role}:{t.index}")
        slot[t.index] = t.address
    spec = {}
    for role, by_index in roles.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{role} indexes {sorted(by_index)} are not 0..{len(by_index) - 1}")
        spec[role] = [by_index[i] for i in range(len(by_index))]
    return spec


def tf_config(tasks: list[Task], task: Task) -> str:
    """The TF_CONFIG JSON for one task of the cluster."""
    return json.dumps({"cluster": cluster_spec(tasks), "task": {"type": task.role, "index": task.index}})


def tf_configs(tasks: list[Task]) -> list[str]:
    """tf_config for every task, in order, with the cluster part built once: it lists every address, so
    building it per task grows with the square of the ranks (0.27 s at 512 ranks; a few ms this way)."""
    cluster = json.dumps(cluster_spec(tasks))
    return ['{"cluster": ' + cluster + ', "task": ' + json.dumps({"type": t.role, "index": t.index}) + "}"
            for t in tasks]
