"""A worker's shard of the data, read from Parquet as NumPy chunks: each column an array of its dtype and
shape, row groups read ahead in threads, epochs of an exact number of rows shuffled anew (or padded with
weight-0 rows). Runs in the actors; no TensorFlow (raytf.actor.pipelines makes tf.data of these chunks).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raytf.data import Column, DatasetInfo, Slice, shard_rows
from raytf.parquet_files import filesystem, is_list, read_piece


def to_numpy(column: pa.ChunkedArray | pa.Array, info: Column):
    """Arrow column -> NumPy array of info.dtype, shape (n, *info.shape); no Python loop per row.
    Nulls take info.fill when the spec gives one, else they are an error naming the column."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        if info.fill is None:
            raise ValueError(f"column {info.name!r} has {array.null_count} null values; set "
                             f"data.fill_nulls.{info.name} in the spec or clean the data")
        if not info.nested:  # a null list has no single value to fill with
            array = pc.fill_null(array, pa.scalar(info.fill, array.type))
        if array.null_count:
            raise ValueError(f"column {info.name!r}: null lists cannot be filled; clean the data")
    if info.dtype == "string" and not info.nested:
        return np.asarray(array.cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object)
    if info.dtype == "bytes":
        return np.asarray(array.to_numpy(zero_copy_only=False), dtype=object)
    if not info.nested:
        return array.to_numpy(zero_copy_only=False).astype(info.dtype, copy=False)
    values = array.storage if isinstance(array, pa.ExtensionArray) else array
    depth = 0
    while is_list(values.type):
        if not pa.types.is_fixed_size_list(values.type) and len(values):  # every row's length at this depth
            lengths = pc.min_max(pc.list_value_length(values)).as_py()
            expected = info.shape[depth] if depth < len(info.shape) else None
            if lengths["min"] != lengths["max"] or lengths["min"] != expected:
                raise ValueError(f"column {info.name!r} is ragged: its lists at depth {depth + 1} have lengths "
                                 f"{lengths['min']}..{lengths['max']}, not {expected} in every row (shape "
                                 f"{list(info.shape)}, from the first row group)")
        values = values.flatten()  # honours slicing, unlike .values
        depth += 1
    if info.dtype == "string":  # a list of strings: text values, none of them null
        if values.null_count:
            raise ValueError(f"column {info.name!r} has {values.null_count} null strings inside its lists; clean the data")
        values = np.asarray(values.cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object)
    else:
        values = values.to_numpy(zero_copy_only=False).astype(info.dtype, copy=False)
    if values.size != len(array) * math.prod(info.shape):
        raise ValueError(f"column {info.name!r}: rows are not all of shape {list(info.shape)}")
    return values.reshape(len(array), *info.shape)


def _read_slice(fs, root: str, info: DatasetInfo, s: Slice) -> tuple:
    names = [c.name for c in (*info.features, info.label)]
    table = read_piece(fs, root, info.pieces[s.piece], names).slice(s.start, s.stop - s.start)
    try:
        return tuple(to_numpy(table.column(c.name), c) for c in (*info.features, info.label))
    except ValueError as exc:
        raise ValueError(f"{info.root}, {info.pieces[s.piece].describe()}: {exc}") from None


def iter_shard(info: DatasetInfo, root: str, shard: list[Slice], read_ahead: int = 2) -> Iterator[tuple]:
    """Yield (feature arrays..., label array) per slice of the shard, in order. Up to `read_ahead`
    row groups are read in background threads (pyarrow releases the GIL while it decodes)."""
    fs, root = filesystem(root)
    with ThreadPoolExecutor(max_workers=max(1, read_ahead)) as pool:
        futures = [pool.submit(_read_slice, fs, root, info, s) for s in shard[:read_ahead]]
        for i in range(len(shard)):
            if i + read_ahead < len(shard):
                futures.append(pool.submit(_read_slice, fs, root, info, shard[i + read_ahead]))
            yield futures[i].result()
            futures[i] = None  # drop the reference: memory stays bounded by the read-ahead


def epoch_chunks(info: DatasetInfo, root: str, shard: list[Slice], epoch_rows: int, shuffle_buffer: int,
                 seed: int, first_epoch: int = 1, pad: bool = False) -> Iterator[tuple]:
    """Endless chunks of rows, exactly `epoch_rows` rows per epoch, epoch after epoch.

    Each epoch has its own random generator seeded from (seed, epoch): row groups come in a random
    order and rows are permuted within windows of about `shuffle_buffer` rows. The shard's rows beyond
    `epoch_rows` (the remainder that does not fill a batch) are dropped, different ones each epoch; a
    shard smaller than `epoch_rows` is read again with a fresh order. With `pad`, every chunk carries
    a weight column: each row of the shard comes once with weight 1, then weight-0 rows fill the epoch
    up to `epoch_rows`. Memory: one window plus the read-ahead."""
    if epoch_rows <= 0:
        raise ValueError(f"epoch_rows must be positive, got {epoch_rows}")
    if shard_rows(shard) == 0 and not pad:
        raise ValueError("this worker's shard has no rows; use fewer workers than rows")
    if pad and shard_rows(shard) > epoch_rows:
        raise ValueError(f"{epoch_rows} rows per epoch cannot hold the shard's {shard_rows(shard)}")
    epoch = first_epoch
    while True:
        rng = np.random.default_rng([seed, epoch])
        if pad:
            sample = None
            for chunk in shuffled_pass(info, root, shard, shuffle_buffer, rng, shard_rows(shard)):
                sample = sample or chunk
                yield (*chunk, np.ones(len(chunk[-1]), np.float32))
            if epoch_rows > shard_rows(shard):
                yield _filler_rows(info, epoch_rows - shard_rows(shard), sample)
            epoch += 1
            continue
        needed = epoch_rows
        while needed > 0:  # a pass over the shard, again while the epoch needs more rows
            for chunk in shuffled_pass(info, root, shard, shuffle_buffer, rng, needed):
                needed -= len(chunk[-1])
                yield chunk
        epoch += 1


def shuffled_pass(info: DatasetInfo, root: str, shard: list[Slice], shuffle_buffer: int, rng,
                  limit: int) -> Iterator[tuple]:
    """One pass over the shard, at most `limit` rows: row groups in random order, rows permuted within
    windows of about `shuffle_buffer` rows (no shuffling when shuffle_buffer is 0)."""
    order = rng.permutation(len(shard)) if shuffle_buffer > 0 else range(len(shard))
    window: list[tuple] = []
    rows = 0
    for arrays in iter_shard(info, root, [shard[i] for i in order]):
        window.append(arrays)
        rows += len(arrays[-1])
        if rows >= min(shuffle_buffer, limit):
            chunk = _permuted(window, rng, shuffle_buffer > 0, limit=limit)
            limit -= len(chunk[-1])
            yield chunk
            window, rows = [], 0
            if limit == 0:
                return
    if window:
        yield _permuted(window, rng, shuffle_buffer > 0, limit=limit)


def _filler_rows(info: DatasetInfo, n: int, sample: tuple | None) -> tuple:
    """n padding rows with weight 0: copies of the first row of `sample` (a chunk of the shard), so they
    go through decoding and preprocessing like real rows (an empty string is no image) and count for
    nothing; zeros and empty strings when the shard has no rows at all."""
    if sample is not None and len(sample[-1]):
        return (*(np.repeat(column[:1], n, axis=0) for column in sample), np.zeros(n, np.float32))
    zeros = [np.full((n, *c.shape), b"", dtype=object) if c.tf_dtype == "string" else np.zeros((n, *c.shape), c.dtype)
             for c in (*info.features, info.label)]
    return (*zeros, np.zeros(n, np.float32))


def _permuted(window: list[tuple], rng, shuffle: bool, limit: int) -> tuple:
    """The window's rows as one chunk, permuted when shuffling, at most `limit` rows."""
    columns = [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*window)]
    n = len(columns[-1])
    if shuffle:
        perm = rng.permutation(n)[:limit]
        return tuple(c[perm] for c in columns)
    return tuple(c[:limit] for c in columns) if n > limit else tuple(columns)


def padded_chunks(info: DatasetInfo, root: str, shard: list[Slice], total_rows: int) -> Iterator[tuple]:
    """Every row of the shard once, with weight 1, then weight-0 rows up to `total_rows`."""
    rows, sample = 0, None
    for arrays in iter_shard(info, root, shard):
        n = len(arrays[-1])
        rows += n
        sample = sample or arrays
        yield (*arrays, np.ones(n, np.float32))
    pad = total_rows - rows
    if pad < 0:
        raise ValueError(f"{total_rows} rows cannot hold the shard's {rows}")
    if pad:
        yield _filler_rows(info, pad, sample)
