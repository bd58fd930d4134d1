"""raytf.actor.initial_values: workers built from different seeds still start from worker 0's weights, with the
per-variable broadcasts of MultiWorkerMirroredStrategy left out (two real TensorFlow processes, no Ray)."""
from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from raytf.actor import initial_values

pytestmark = pytest.mark.timeout(120)

Var = collections.namedtuple("Var", "name dtype shape")


def test_chunks_group_by_dtype_in_order_and_cut_at_the_limit():
    a, b, c = Var("a", tf.float32, (3, 4)), Var("b", tf.float64, (2,)), Var("c", tf.float32, (10,))
    d, e = Var("d", tf.float32, (2, 2)), Var("e", tf.float32, (30,))
    assert initial_values.chunks([a, b, c, d, e], limit=24) == [[a, c], [d], [e], [b]]  # 12+10 | 4 (+30 > 24) | 30
    assert initial_values.chunks([], limit=24) == []


def test_fingerprints_tell_values_apart_and_are_exact_in_a_float64_sum():
    x = np.random.RandomState(0).rand(100, 7).astype("float32")
    y = x.copy()
    y[50, 3] = np.nextafter(y[50, 3], 2)  # one bit
    fx = initial_values.fingerprint(x)
    assert fx == initial_values.fingerprint(x.copy()) and fx != initial_values.fingerprint(y)
    assert fx == int(fx) and fx < 2 ** 52 and fx + 0.0 + 0.0 == fx


WORKER = r'''
import hashlib, json, os, sys
rank, ports = int(sys.argv[1]), sys.argv[2].split(",")
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                      "task": {"type": "worker", "index": rank}})
import keras, tensorflow as tf
from tensorflow.python.ops import collective_ops
from raytf.actor import initial_values

broadcasts = []
for name in ("broadcast_send", "broadcast_recv"):  # count TensorFlow's own per-variable broadcasts
    original = getattr(collective_ops, name)
    setattr(collective_ops, name, lambda *a, _o=original, **k: broadcasts.append(1) or _o(*a, **k))
strategy = tf.distribute.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(rank)  # each worker's own initial values, unlike raytf's runs
with strategy.scope(), initial_values.one_broadcast(strategy):
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.3), keras.layers.Dense(3)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.variables + optimizer.variables)).hexdigest()
print(json.dumps({"rank": rank, "digest": digest, "broadcasts": len(broadcasts),
                  "packed": sum(initial_values.packable({"dtype": v.dtype}) for v in model.variables + optimizer.variables),
                  "variables": len(model.variables + optimizer.variables)}), flush=True)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_seeded_apart_end_with_worker_0s_weights_and_broadcast_only_what_is_not_float():
    ports = ",".join(str(_free_port()) for _ in range(2))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), ports], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=100)
        finally:
            proc.kill()
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["digest"] == outs[1]["digest"]  # every weight, slot and statistic: worker 0's
    for out in outs:
        # the optimizer's step counter and the random state (Dropout's seed generator) are not float: broadcast
        # one by one, as TensorFlow does; the float ones (weights, BN statistics, Adam's slots) are not
        assert 0 < out["broadcasts"] <= out["variables"] - out["packed"], out
