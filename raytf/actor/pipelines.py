"""The tf.data pipelines a worker trains and evaluates on, over its shard: streamed from Parquet as chunks
of rows (raytf.actor.shard_reader) and cut into batches in C++; under parameter_server, from TFRecord files
of its shard that the chief's pipeline reads with TF ops only. TensorFlow is imported inside the functions.
"""
from __future__ import annotations

import os

from raytf.actor.shard_reader import epoch_chunks, iter_shard, padded_chunks, shuffled_pass
from raytf.data import DatasetInfo, Slice, shard_rows


def _signature(info: DatasetInfo, weight: bool = False):
    import tensorflow as tf

    specs = tuple(tf.TensorSpec(shape=(None, *c.shape), dtype=c.tf_dtype) for c in (*info.features, info.label))
    return specs + ((tf.TensorSpec(shape=(None,), dtype=tf.float32),) if weight else ())


def _pack(info: DatasetInfo):
    """Column tuple -> (x, y[, w]): x is the one feature's tensor, or a dict by name when there are several."""
    names = [c.name for c in info.features]
    n = len(names)

    def pack(*columns):
        features, label, rest = columns[:n], columns[n], columns[n + 1:]
        x = features[0] if n == 1 else dict(zip(names, features))
        return (x, label, *rest)

    return pack


def _packed(ds, info: DatasetInfo):
    """Columns -> (x, y[, w]). One feature is already in that shape: no map, so no per-batch op."""
    import tensorflow as tf

    if len(info.features) == 1:
        return ds
    return ds.map(_pack(info), num_parallel_calls=tf.data.AUTOTUNE)


def train_dataset(info: DatasetInfo, root: str, shard: list[Slice], batch_size: int, batches_per_epoch: int,
                  shuffle_buffer: int, seed: int, first_epoch: int = 1, pad: bool = False, micro_batches: int = 1,
                  examples=None, worker: int = 0):
    """This worker's training batches for all epochs, as one endless dataset: every epoch is exactly
    `batches_per_epoch` batches of `batch_size` rows (see epoch_chunks for the order and the remainder).
    One dataset and one iterator serve the whole run, so no epoch pays for building a pipeline. Chunks
    come from a Python generator (one call per shuffle window, not per row or batch) and are cut into
    batches by tf.data's `rebatch`, in C++. micro_batches K > 1 (gradient accumulation): each element
    stacks K consecutive batches, [K, batch_size, ...] (batches_per_epoch is then a multiple of K).
    `examples` (raytf.actor.examples.Examples, for data.decode/preprocess/cache): rows go one by one
    through its maps and are batched after; with a cache, the epoch is the next `batches_per_epoch`
    batches of an endless stream of passes over the cached shard, shuffled within `shuffle_buffer`."""
    import numpy as np
    import tensorflow as tf

    epoch_rows = batches_per_epoch * batch_size
    stream_seed = seed * 1000 + first_epoch  # a resumed run does not replay the first epoch's order
    if examples is not None and examples.cache != "none":
        # The cache keeps its first pass's order (row groups and windows shuffled, as epoch 1 would read
        # them); every later pass is reshuffled within shuffle_buffer.
        first_pass = lambda: shuffled_pass(info, root, shard, shuffle_buffer,  # noqa: E731
                                           np.random.default_rng([seed, first_epoch]), shard_rows(shard))
        rows = tf.data.Dataset.from_generator(first_pass, output_signature=_signature(info))
        stream = examples.cached(examples.decoded(rows.unbatch(), weighted=False), f"train-{worker}").repeat()
        if shuffle_buffer > 0:
            stream = stream.shuffle(shuffle_buffer, seed=stream_seed)
        ds = examples.prepared(stream, stream_seed, worker, weighted=False).batch(batch_size, drop_remainder=True)
    else:
        ds = tf.data.Dataset.from_generator(
            lambda: epoch_chunks(info, root, shard, epoch_rows, shuffle_buffer, seed, first_epoch, pad),
            output_signature=_signature(info, weight=pad))
        if examples is not None:  # each row's preprocess seed is its place in the whole run, resumed or not
            ds = examples.prepared(ds.unbatch(), seed * 1000 + 1, worker, weighted=pad, decode=True,
                                   first_index=(first_epoch - 1) * epoch_rows).batch(batch_size, drop_remainder=True)
        else:
            ds = _packed(ds.rebatch(batch_size, drop_remainder=True), info)
    if micro_batches > 1:
        ds = ds.batch(micro_batches, drop_remainder=True)
    # Endless, and said so: MultiWorkerMirrored then reads each worker's batch on its own, instead of
    # all-reducing a "has data" flag across workers at every step (its partial-batch handling, for
    # datasets that may end) -- one collective less per step, and a worker's input wait is its own.
    return ds.prefetch(tf.data.AUTOTUNE).apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))


def eval_dataset(info: DatasetInfo, root: str, shard: list[Slice], batch_size: int, steps: int,
                 repeat: bool = False, examples=None, worker: int = 0):
    """Every row of the shard once, padded to exactly `steps` batches; padding rows carry weight 0,
    so every worker runs the same number of steps and no row is dropped or counted twice. With
    `repeat`, the same `steps` batches again and again (one pipeline for every epoch's validation).
    `examples`: rows go through its maps one by one (a cache holds the decoded pass)."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(lambda: padded_chunks(info, root, shard, steps * batch_size),
                                        output_signature=_signature(info, weight=True))
    if examples is not None:  # the same seeds every pass: validation sees the same examples each epoch
        if examples.cache == "none":
            rows = examples.prepared(ds.unbatch(), 0, worker, weighted=True, decode=True)
        else:
            rows = examples.cached(examples.decoded(ds.unbatch(), weighted=True), f"validation-{worker}")
            rows = examples.prepared(rows, 0, worker, weighted=True)
        rows = rows.repeat() if repeat else rows
        return rows.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    if repeat:
        ds = ds.repeat()
    ds = ds.rebatch(batch_size, drop_remainder=True)
    return _packed(ds, info).prefetch(tf.data.AUTOTUNE)


# ---------------------------------------------------------------- parameter-server workers
# Under ParameterServerStrategy the chief builds each worker's pipeline and the worker runs it, in
# another process: a Python generator (py_func) cannot run there. So each worker actor first converts
# its shard into TFRecord files on its local disk (one file per column; record k of every file holds the
# k-th chunk of rows as a serialized tensor), and the pipeline the chief builds reads them with TF ops
# only. The folder is relative: each worker process has its own working directory (its staging folder),
# so one pipeline definition reads a different shard on every worker.

RECORDS_DIR = "raytf-records"
RECORD_CHUNK_ROWS = 4096


def write_records(info: DatasetInfo, root: str, shard: list[Slice], folder: str,
                  chunk_rows: int = RECORD_CHUNK_ROWS) -> int:
    """Write the shard's rows under `folder` (see above); returns the number of rows written."""
    import tensorflow as tf

    if shard_rows(shard) == 0:
        raise ValueError("this worker's shard has no rows; use fewer workers than rows")
    os.makedirs(folder, exist_ok=True)
    columns = (*info.features, info.label)
    writers = [tf.io.TFRecordWriter(os.path.join(folder, f"col-{i}.tfrecord")) for i in range(len(columns))]
    rows = 0
    try:
        for arrays in iter_shard(info, root, shard):
            n = len(arrays[-1])
            for start in range(0, n, chunk_rows):
                for writer, array in zip(writers, arrays):
                    writer.write(tf.io.serialize_tensor(array[start:start + chunk_rows]).numpy())
            rows += n
    finally:
        for writer in writers:
            writer.close()
    return rows


def record_dataset(info: DatasetInfo, folder: str, batch_size: int, shuffle_buffer: int, seed: int,
                   micro_batches: int = 1, examples=None, worker=0):
    """A worker's records (under `folder`, relative to its working directory), endlessly: chunks in a
    new random order every pass, rows shuffled within `shuffle_buffer`, cut into batches. TF ops only.
    micro_batches K > 1 (gradient accumulation): each element is [batch_size, K, ...], micro-batch k
    being [:, k]; batch-major, so a worker with several GPUs still splits the batch along axis 0.
    `examples`: rows go through its maps one by one (`worker`: a tensor, this worker's index, for the
    per-example seeds); a disk cache lives beside the records."""
    import tensorflow as tf

    def column(i, spec):
        def parse(record):
            return tf.ensure_shape(tf.io.parse_tensor(record, spec.dtype), spec.shape)
        return tf.data.TFRecordDataset(f"{folder}/col-{i}.tfrecord").map(parse)

    ds = tf.data.Dataset.zip(tuple(column(i, s) for i, s in enumerate(_signature(info))))
    if shuffle_buffer > 0:
        ds = ds.shuffle(1024, seed=seed, reshuffle_each_iteration=True)  # chunk order: the whole shard, up to 4M rows
    cached = examples is not None and examples.cache != "none"
    if cached:
        ds = examples.cached(examples.decoded(ds.unbatch(), weighted=False), f"{folder}/cache").repeat()
    else:
        ds = ds.repeat().unbatch()
    if shuffle_buffer > 0:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if examples is not None:  # rows shuffled before decoding: the shuffle buffer holds the small encoded bytes
        ds = examples.prepared(ds, seed, worker, weighted=False, decode=not cached)
    if micro_batches > 1:
        ds = ds.batch(micro_batches, drop_remainder=True)
    ds = ds.batch(batch_size, drop_remainder=True)
    return (ds if examples is not None else _packed(ds, info)).prefetch(tf.data.AUTOTUNE)
