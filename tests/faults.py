"""Fault injection for the fault-tolerance tests: kill a rank's actor (or a whole node) once training
has passed a given step, from a thread that watches progress closely."""
from __future__ import annotations

import threading
import time

import ray

from raytf.driver.ray_group import RayWorkerGroup


class Killer:
    """Makes a WorkerGroup class whose attempts get rank `rank` killed at global step >= `at_step`,
    on the attempts listed (1-based; None: every attempt). `kill` may be replaced (e.g. remove a node)."""

    def __init__(self, rank: int, at_step: int, attempts: set[int] | None = None, kill=None, watch: int | None = None):
        # watch: the rank whose global step counts (default: the killed rank; a parameter-server job's
        # ps and workers report no steps, its chief does)
        self.rank, self.at_step, self.attempts = rank, at_step, attempts
        self.watch = rank if watch is None else watch
        self.kill = kill or (lambda actor: ray.kill(actor, no_restart=True))
        self.killed_at: list[tuple[int, float]] = []  # (attempt, time)
        self.attempt = 0
        killer = self

        class KillingGroup(RayWorkerGroup):
            def train(self, payload):
                refs = super().train(payload)
                killer.attempt += 1
                if killer.attempts is None or killer.attempt in killer.attempts:
                    threading.Thread(target=killer._watch, args=(self, killer.attempt), daemon=True).start()
                return refs

        self.group_cls = KillingGroup

    def _watch(self, group: RayWorkerGroup, attempt: int) -> None:
        actor, watched = group._by_rank[self.rank], group._by_rank[self.watch]
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                progress = ray.get(watched.progress.remote(), timeout=5)
            except Exception:
                return  # the attempt ended some other way
            if progress.get("global_step", 0) >= self.at_step:
                self.killed_at.append((attempt, time.time()))
                self.kill(actor)
                return
            time.sleep(0.05)
