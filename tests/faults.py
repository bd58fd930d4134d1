"""Fault injection for the fault-tolerance tests: kill a rank's actor (or a whole node) once training
has passed a given step, from a thread that watches progress closely; or a dataset_fn whose rank 1
stalls, alive, without dying."""
from __future__ import annotations

import textwrap
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


# A dataset_fn module: rank 1 stalls at its 30th row (once: the marker file says it did), alive but silent.
STALLING_DATA = textwrap.dedent('''
    import json, os, time
    import numpy as np
    import tensorflow as tf

    MARKER = {marker!r}  # absolute: every node, every attempt sees the same file

    def dataset_fn(ctx):
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        rng = np.random.default_rng(rank)
        x = rng.normal(size=(64, 64)).astype("float32")
        y = rng.integers(0, 10, size=64)

        def gen():
            for i in range(10**9):
                if rank == 1 and i == 30 and not os.path.exists(MARKER):
                    open(MARKER, "w").write(str(time.time()))
                    time.sleep(3600)  # stalls without dying
                yield x[i % 64], y[i % 64]

        sig = (tf.TensorSpec((64,), tf.float32), tf.TensorSpec((), tf.int64))
        return tf.data.Dataset.from_generator(gen, output_signature=sig).batch(ctx.get_per_replica_batch_size(16))
''')
