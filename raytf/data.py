"""Parquet through pyarrow into per-worker tf.data pipelines.

The driver describes a data set from Parquet metadata alone (files, row groups, row counts, column types),
`plan_shards` splits its rows over the workers (pure: contiguous, balanced ranges, so every row belongs
to exactly one worker), and each worker streams only its own row ranges into tf.data.
TensorFlow is imported only inside the functions that build pipelines (they run in the actors).
"""
from __future__ import annotations

import dataclasses
import glob as globlib
import os
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytf.errors import SpecError


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # numpy dtype name the tensor will have
    dim: int | None  # None: a scalar per row; else a vector of this length


@dataclasses.dataclass(frozen=True)
class Piece:
    """One row group of one file, the unit pyarrow reads."""

    file: str  # path relative to the data set root ("" when the root is the file itself)
    row_group: int
    num_rows: int


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    root: str
    pieces: tuple[Piece, ...]
    features: tuple[Column, ...]
    label: Column

    @property
    def num_rows(self) -> int:
        return sum(p.num_rows for p in self.pieces)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(p.file for p in self.pieces))


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows [start, stop) of piece `piece` (an index into DatasetInfo.pieces)."""

    piece: int
    start: int
    stop: int


# ---------------------------------------------------------------- sharding (pure)


def plan_shards(piece_rows: list[int], num_workers: int) -> list[list[Slice]]:
    """Split the concatenated rows of all pieces into `num_workers` contiguous ranges whose sizes differ
    by at most one row; worker w gets rows [w*N//W, (w+1)*N//W). Every row lands in exactly one shard,
    whatever the file and row-group sizes, also with fewer pieces than workers."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    total_rows = sum(piece_rows)
    bounds = [w * total_rows // num_workers for w in range(num_workers + 1)]
    shards: list[list[Slice]] = [[] for _ in range(num_workers)]
    piece_start = 0
    worker = 0
    for index, rows in enumerate(piece_rows):
        piece_end = piece_start + rows
        while worker < num_workers and bounds[worker] < piece_end:
            lo = max(bounds[worker], piece_start)
            hi = min(bounds[worker + 1], piece_end)
            if hi > lo:
                shards[worker].append(Slice(index, lo - piece_start, hi - piece_start))
            if bounds[worker + 1] <= piece_end:
                worker += 1
            else:
                break
        piece_start = piece_end
    return shards


def shard_rows(shard: list[Slice]) -> int:
    return sum(s.stop - s.start for s in shard)


# ---------------------------------------------------------------- describing (driver side)


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
            raise SpecError(f"{path}: pyarrow cannot open this URI ({exc})") from None
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _list_parquet_files(fs: pafs.FileSystem, root: str, key: str) -> list[str]:
    """Paths relative to root; a file root gives [""]; a glob gives its matches."""
    if any(ch in root for ch in "*?[") and isinstance(fs, pafs.LocalFileSystem):
        matches = sorted(m for m in globlib.glob(root) if os.path.isfile(m))
        if not matches:
            raise SpecError(f"{key}: {root!r} matches no files; check the pattern")
        return matches
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise SpecError(f"{key}: {root!r} does not exist; give a Parquet file or a directory of them")
    if info.type == pafs.FileType.File:
        return [""]
    selector = pafs.FileSelector(root, recursive=True)
    files = sorted(
        os.path.relpath(i.path, root) for i in fs.get_file_info(selector)
        if i.type == pafs.FileType.File and not os.path.basename(i.path).startswith(("_", "."))
    )
    if not files:
        raise SpecError(f"{key}: directory {root!r} holds no Parquet files")
    return files


def _column_info(field: pa.Field, key: str) -> Column:
    t = field.type
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return Column(field.name, "float32", None)
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return Column(field.name, "int64", None)
    if pa.types.is_fixed_size_list(t) and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type)):
        return Column(field.name, "float32", t.list_size)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type):
            return Column(field.name, "float32", -1)  # length found from the first row group
    raise SpecError(f"{key}: column {field.name!r} has type {t}, which raytf cannot make a tensor from; "
                    f"use numbers or lists of numbers")


def _join(root: str, rel: str) -> str:
    return root if not rel else (rel if os.path.isabs(rel) else f"{root.rstrip('/')}/{rel}")


def describe(path: str, features: list[str], label: str, key: str = "data") -> DatasetInfo:
    """Read Parquet metadata (not data) and check the named columns; SpecError on anything unusable."""
    fs, root = _filesystem(path)
    files = _list_parquet_files(fs, root, key)
    pieces: list[Piece] = []
    schema = None
    for rel in files:
        full = _join(root, rel)
        try:
            with fs.open_input_file(full) as handle:
                meta = pq.ParquetFile(handle).metadata
                file_schema = meta.schema.to_arrow_schema()
        except (pa.ArrowInvalid, OSError) as exc:
            raise SpecError(f"{key}: {full!r} is not a readable Parquet file ({exc})") from None
        schema = schema or file_schema
        pieces.extend(Piece(rel, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
                      if meta.row_group(g).num_rows > 0)
    if not pieces:
        raise SpecError(f"{key}: {path!r} has no rows")
    missing = [c for c in [*features, label] if c not in schema.names]
    if missing:
        raise SpecError(f"{key}: column(s) {missing} not in {path!r}; its columns are {schema.names}")
    columns = {c: _column_info(schema.field(c), key) for c in [*features, label]}
    variable = [c for c, info in columns.items() if info.dim == -1]
    if variable:  # list<float>: every row must have one length; read it off the first row group
        first = _read_piece(fs, root, pieces[0], variable)
        for c in variable:
            lengths = pa.compute.list_value_length(first.column(c)).unique().to_pylist()
            if len(lengths) != 1 or lengths[0] is None:
                raise SpecError(f"{key}: column {c!r} holds lists of lengths {sorted(x for x in lengths if x is not None)}; "
                                f"a vector feature needs one length in every row")
            columns[c] = Column(c, "float32", int(lengths[0]))
    if columns[label].dim is not None:
        raise SpecError(f"{key}: label {label!r} is a list column; the label must be one number per row")
    return DatasetInfo(root=path, pieces=tuple(pieces), features=tuple(columns[f] for f in features),
                       label=columns[label])


def _read_piece(fs: pafs.FileSystem, root: str, piece: Piece, columns: list[str]) -> pa.Table:
    with fs.open_input_file(_join(root, piece.file)) as handle:
        return pq.ParquetFile(handle).read_row_group(piece.row_group, columns=columns)


# ---------------------------------------------------------------- reading (worker side)


def to_numpy(column: pa.ChunkedArray | pa.Array, info: Column):
    """Arrow column -> NumPy array of info.dtype, shape (n,) or (n, dim); no Python loop per row."""
    import numpy as np

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        raise ValueError(f"column {info.name!r} has {array.null_count} null values; fill them before training")
    if info.dim is None:
        return array.to_numpy(zero_copy_only=False).astype(info.dtype, copy=False)
    values = array.flatten().to_numpy(zero_copy_only=False).astype(info.dtype, copy=False)
    if values.size != len(array) * info.dim:
        raise ValueError(f"column {info.name!r}: rows are not all of length {info.dim}")
    return values.reshape(len(array), info.dim)


def iter_shard(info: DatasetInfo, root: str, shard: list[Slice]) -> Iterator[tuple]:
    """Yield (feature arrays..., label array) per slice of this worker's shard, one row group at a time."""
    fs, root = _filesystem(root)
    names = [c.name for c in info.features] + [info.label.name]
    for s in shard:
        table = _read_piece(fs, root, info.pieces[s.piece], names).slice(s.start, s.stop - s.start)
        yield tuple(to_numpy(table.column(c.name), c) for c in (*info.features, info.label))


def _signature(info: DatasetInfo):
    import tensorflow as tf

    return tuple(tf.TensorSpec(shape=(None,) if c.dim is None else (None, c.dim), dtype=c.dtype)
                 for c in (*info.features, info.label))


def _rows(info: DatasetInfo, root: str, shard: list[Slice]):
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(lambda: iter_shard(info, root, shard), output_signature=_signature(info))
    return ds.unbatch()


def _pack(info: DatasetInfo):
    """Row tuple -> (x, y): x is the one feature's tensor, or a dict by name when there are several."""
    names = [c.name for c in info.features]

    def pack(*row):
        *features, label = row
        x = features[0] if len(features) == 1 else dict(zip(names, features))
        return x, label

    return pack


def train_dataset(info: DatasetInfo, root: str, shard: list[Slice], batch_size: int, steps: int,
                  shuffle_buffer: int, seed: int, repeat: bool):
    """This worker's training batches for one epoch: exactly `steps` batches of `batch_size` rows
    (the remainder of the shard that does not fill a batch is dropped, a different one each epoch
    because the shuffle is reseeded per epoch by the caller)."""
    import tensorflow as tf

    ds = _rows(info, root, shard)
    if shuffle_buffer > 0:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    ds = ds.map(_pack(info), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).take(steps).prefetch(tf.data.AUTOTUNE)


def eval_dataset(info: DatasetInfo, root: str, shard: list[Slice], batch_size: int, steps: int):
    """Every row of the shard once, padded to exactly `steps` batches; padding rows carry weight 0,
    so every worker runs the same number of steps and no row is dropped or counted twice."""
    import tensorflow as tf

    rows = shard_rows(shard)
    pad = steps * batch_size - rows
    if pad < 0:
        raise ValueError(f"{steps} steps of {batch_size} cannot hold {rows} rows")
    pack = _pack(info)
    real = _rows(info, root, shard).map(lambda *row: (*pack(*row), tf.constant(1.0)))
    if pad:
        zeros = tuple(tf.zeros(spec.shape[1:], spec.dtype) for spec in _signature(info))
        padding = tf.data.Dataset.from_tensors(zeros).repeat(pad).map(lambda *row: (*pack(*row), tf.constant(0.0)))
        real = real.concatenate(padding)
    return real.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
