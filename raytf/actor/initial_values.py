"""Every worker starts from worker 0's initial weights, in two small collectives instead of one per variable.

Under MultiWorkerMirroredStrategy TensorFlow gives each new variable worker 0's initial value by a broadcast of
its own: one collective round trip per variable, while the model is built, at every start and restart (ResNet50
with Adam, 750 variables, 2 workers on localhost: 5.2-7.0 s to build, 2.2 s of it without the strategy).
`one_broadcast` lets the floating-point variables built inside it keep each worker's own initial value (raytf
seeds every worker alike, so they are equal already), compares a checksum of each with worker 0's (two sums of
one number per variable), and sends only those that differ, worker 0's values summed with the others' zeros
(exact), in chunks of CHUNK_ELEMENTS. Other dtypes (a step counter, a random generator's state) and variables
made later keep TensorFlow's broadcast. benchmarks/bench_model_build.py measures it.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy

PACKED_DTYPES = (tf.float32, tf.float64)  # summed exactly (x + 0 = x) by every collective implementation
CHUNK_ELEMENTS = 1 << 24  # 64 MiB of float32 per collective: the sum's copies stay bounded for a large model


def packable(kwargs: dict) -> bool:
    """Whether a variable created with these arguments gets its initial value from the packed sum."""
    dtype = kwargs.get("dtype")
    return dtype is not None and tf.as_dtype(dtype) in PACKED_DTYPES


@contextlib.contextmanager
def one_broadcast(strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Enter inside `strategy.scope()`, around building the model and its optimizer. Under any other strategy, one
    worker, or a TensorFlow whose private method moved, TensorFlow's per-variable broadcast stays."""
    extended = strategy.extended
    broadcast = getattr(extended, "_get_variable_creator_initial_value", None)
    if (not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or broadcast is None
            or getattr(extended, "_num_workers", 1) <= 1):
        yield
        return
    created: list = []

    def initial_value(replica_id, device, primary_var, **kwargs):
        if replica_id == 0 and packable(kwargs):  # this worker's own value (MirroredStrategy's way: no collective)
            return mirrored_strategy.MirroredExtended._get_variable_creator_initial_value(
                extended, replica_id, device, primary_var, **kwargs)
        return broadcast(replica_id, device, primary_var, **kwargs)

    def record(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        if packable(kwargs):
            created.append(variable)
        return variable

    extended._get_variable_creator_initial_value = initial_value
    try:
        with tf.variable_creator_scope(record):
            yield
    finally:
        del extended._get_variable_creator_initial_value  # the class's own again
    _to_first_replicas_values(strategy, created)


def chunks(variables: list, limit: int) -> list[list]:
    """`variables` grouped by dtype, in creation order, each group cut into runs of at most `limit` elements (a
    larger variable alone)."""
    out: list[list] = []
    for dtype in PACKED_DTYPES:
        run, size = [], 0
        for v in (v for v in variables if v.dtype == dtype):
            n = math.prod(v.shape)
            if run and size + n > limit:
                out.append(run)
                run, size = [], 0
            run.append(v)
            size += n
        if run:
            out.append(run)
    return out


def _to_first_replicas_values(strategy: tf.distribute.Strategy, variables: list) -> None:
    """Give every replica the first replica's values of `variables`, sending only those that differ somewhere."""
    if not variables:
        return
    differ = _differing(strategy, [fingerprint(v.numpy()) for v in variables])
    for chunk in chunks([v for v, d in zip(variables, differ) if d], CHUNK_ELEMENTS):
        _from_first_replica(strategy, chunk)


def fingerprint(values: np.ndarray) -> float:
    """52 bits of a checksum of `values`' bytes, as a float64 (a sum of one of them and zeros is exact)."""
    data = np.ascontiguousarray(values).tobytes()
    return float(((zlib.crc32(data) << 20) ^ zlib.adler32(data)) & ((1 << 52) - 1))


def _differing(strategy: tf.distribute.Strategy, prints: list[float]) -> list[bool]:
    """Per variable, whether any replica's fingerprint differs from the first replica's (two small sums)."""
    local = tf.constant(prints, tf.float64)
    first = _sum(strategy, local, tf.zeros_like(local))
    mismatch = tf.cast(tf.not_equal(local, first), tf.float64)
    return [bool(m) for m in _sum(strategy, mismatch, mismatch).numpy()]


def _sum(strategy: tf.distribute.Strategy, first_replicas, others):
    """The sum over all replicas of `first_replicas` on the first replica of worker 0 and `others` elsewhere."""
    shares = strategy.experimental_distribute_values_from_function(
        lambda ctx: first_replicas if ctx.replica_id_in_sync_group == 0 else others)
    return strategy.reduce(tf.distribute.ReduceOp.SUM, shares, axis=None)


def _from_first_replica(strategy: tf.distribute.Strategy, variables: list) -> None:
    """Set `variables` to the first replica's values by one sum over all replicas."""
    sizes = [math.prod(v.shape) for v in variables]
    local = tf.concat([tf.reshape(v.read_value(), [-1]) for v in variables], axis=0)  # this worker's first replica's
    total = _sum(strategy, local, tf.zeros_like(local))
    for v, part in zip(variables, tf.split(total, sizes)):
        for component in strategy.experimental_local_results(v):  # each local replica's (an assign to the mirrored
            component.assign(tf.reshape(part, v.shape))             # variable goes through the strategy: ~3 ms each)
