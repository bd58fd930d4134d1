"""Parquet through pyarrow into per-worker tf.data pipelines.

The driver describes a data set from Parquet metadata alone (files, row groups, row counts, column types),
`plan_shards` splits its rows over the workers (pure: contiguous, balanced ranges, so every row belongs
to exactly one worker), and each worker streams only its own row ranges into tf.data.
TensorFlow is imported only inside the functions that build pipelines (they run in the actors).
"""
from __future__ import annotations

import dataclasses
import glob as globlib
import math
import os
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytf.errors import SpecError


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # numpy dtype name the tensor will have, "string" (text) or "bytes" (binary, e.g. an encoded image)
    shape: tuple[int, ...] = ()  # one row's: () a scalar, (n,) a vector, (h, w, c) a tensor; -1: read from the data
    fill: float | str | None = None  # value for nulls (data.fill_nulls); None: nulls are an error
    # the stored numbers' kind before any cast ("integer" | "float"; "" for strings, bytes): a label vector of
    # floats is one-hot or regression targets, one of integers may be per-position class ids
    values: str = dataclasses.field(default="", compare=False)

    @property
    def tf_dtype(self) -> str:
        return "string" if self.dtype in ("string", "bytes") else self.dtype

    @property
    def nested(self) -> bool:
        """Whether rows are lists (of lists...), read as a flat run of values and reshaped."""
        return bool(self.shape)


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
    if any(ch in root for ch in "*?[") and isinstance(fs, pafs.LocalFileSystem) and not os.path.exists(root):
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


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _list_shape(t: pa.DataType) -> tuple[tuple[int, ...], pa.DataType] | None:
    """A (nested) list type's shape (-1 where rows may differ: read from the data) and its value type."""
    shape = []
    while _is_list(t):
        shape.append(t.list_size if pa.types.is_fixed_size_list(t) else -1)
        t = t.value_type
    return (tuple(shape), t) if shape else None


def _column_info(field: pa.Field, key: str) -> Column:
    t = field.type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Column(field.name, "string")  # categorical: the model maps strings to ids
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return Column(field.name, "bytes")  # e.g. an encoded image: data.decode or data.preprocess decodes it
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return Column(field.name, "float32", values="float")
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return Column(field.name, "int64", values="integer")
    if isinstance(t, pa.FixedShapeTensorType) and _is_number(t.value_type):  # Arrow's tensor extension type
        if t.permutation is not None and list(t.permutation) != sorted(t.permutation):
            raise SpecError(f"{key}: column {field.name!r} is a tensor stored permuted ({list(t.permutation)}); "
                            f"write it in row-major order (permutation none)")
        return Column(field.name, _tensor_dtype(t.value_type), tuple(t.shape), values=_values_kind(t.value_type))
    nested = _list_shape(t)
    if nested is not None and _is_number(nested[1]):
        shape, value_type = nested
        return Column(field.name, _tensor_dtype(value_type) if len(shape) > 1 else "float32", shape,
                      values=_values_kind(value_type))
    if nested is not None and _is_text(nested[1]):  # e.g. tags: a fixed number of strings per row, (batch, n)
        return Column(field.name, "string", nested[0])
    raise SpecError(f"{key}: column {field.name!r} has type {t}, which raytf cannot make a tensor from; "
                    f"use numbers, (nested) lists of numbers or strings, tensors, strings or binary")


def _values_kind(t: pa.DataType) -> str:
    return "float" if pa.types.is_floating(t) else "integer"


def _tensor_dtype(t: pa.DataType) -> str:
    """A tensor column's dtype: uint8 stays (images, a quarter of float32's memory), other numbers float32."""
    return "uint8" if pa.types.is_uint8(t) else "float32"


def _join(root: str, rel: str) -> str:
    return root if not rel else (rel if os.path.isabs(rel) else f"{root.rstrip('/')}/{rel}")


@dataclasses.dataclass(frozen=True)
class Scan:
    """What Parquet metadata says about a data set, before any column is chosen."""

    root: str
    schema: pa.Schema
    pieces: tuple[Piece, ...]
    null_counts: dict[str, int]  # top-level column -> nulls per the files' statistics (where written)
    leaf_values: tuple[dict[str, int], ...] = ()  # per piece: list column -> values at its innermost level

    @property
    def num_rows(self) -> int:
        return sum(p.num_rows for p in self.pieces)


def scan(path: str, key: str = "data") -> Scan:
    """Files, row groups, schema and null counts from Parquet footers; reads no column data."""
    fs, root = _filesystem(path)
    files = _list_parquet_files(fs, root, key)
    pieces: list[Piece] = []
    leaves: list[dict[str, int]] = []
    schema = None
    nulls: dict[str, int] = {}
    for rel in files:
        full = _join(root, rel)
        try:
            with fs.open_input_file(full) as handle:
                meta = pq.ParquetFile(handle).metadata
                file_schema = meta.schema.to_arrow_schema()
        except (pa.ArrowInvalid, OSError) as exc:
            raise SpecError(f"{key}: {full!r} is not a readable Parquet file ({exc})") from None
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema):
            different = sorted(set(schema.names) ^ set(file_schema.names)) or [
                n for n in schema.names if schema.field(n).type != file_schema.field(n).type]
            raise SpecError(f"{key}: {full!r} has a different schema from the first file (columns {different}); "
                            f"all files of a data set need one schema")
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            leaf = {}
            for c in range(group.num_columns):
                column = group.column(c)
                name = column.path_in_schema.split(".")[0]
                if "." in column.path_in_schema:  # a list column's values: how many, for the shape check
                    leaf[name] = column.num_values
                stats = column.statistics
                if stats is not None and stats.has_null_count and stats.null_count:
                    nulls[name] = nulls.get(name, 0) + stats.null_count
            if group.num_rows > 0:
                pieces.append(Piece(rel, g, group.num_rows))
                leaves.append(leaf)
    if not pieces:
        raise SpecError(f"{key}: {path!r} has no rows")
    return Scan(root=path, schema=schema, pieces=tuple(pieces), null_counts=nulls, leaf_values=tuple(leaves))


def read_info(path: str, features: list[str], label: str, key: str = "data",
             fill_nulls: dict[str, float | str] | None = None) -> DatasetInfo:
    """Check the named columns against the metadata; SpecError on anything unusable."""
    fill_nulls = fill_nulls or {}
    found = scan(path, key)
    schema = found.schema
    missing = [c for c in [*features, label] if c not in schema.names]
    if missing:
        raise SpecError(f"{key}: column(s) {missing} not in {path!r}; its columns are {schema.names}")
    columns = {c: dataclasses.replace(_column_info(schema.field(c), key), fill=fill_nulls.get(c))
               for c in [*features, label]}
    for c, info in columns.items():
        if found.null_counts.get(c) and info.fill is None:
            raise SpecError(f"{key}: column {c!r} has {found.null_counts[c]:,} null values; set "
                            f"data.fill_nulls: {{{c}: <value>}} or clean the data")
    variable = [c for c, info in columns.items() if -1 in info.shape]
    if variable:  # lists without a fixed size: one shape in every row, read off the first row group
        fs, root = _filesystem(path)
        first = _read_piece(fs, root, found.pieces[0], variable)
        for c in variable:
            columns[c] = dataclasses.replace(columns[c], shape=_rows_shape(first.column(c), c, key, found.pieces[0]))
    for c, info in columns.items():  # every row group holds rows x shape values (its footer says, no read)
        if info.nested:
            _check_leaf_values(found, info, key)
    if columns[label].dtype in ("string", "bytes"):  # numbers, or fixed-size lists of them (one-hot, multi-output)
        raise SpecError(f"{key}: label {label!r} has type {schema.field(label).type}; the label must be numbers: one "
                        f"per row, or a fixed-size list of them (map string classes to integer ids first)")
    return DatasetInfo(root=path, pieces=found.pieces, features=tuple(columns[f] for f in features),
                       label=columns[label])


def _where(piece: Piece) -> str:
    return f"row group {piece.row_group}" + (f" of {piece.file}" if piece.file else "")


def _rows_shape(column: pa.ChunkedArray, name: str, key: str, piece: Piece) -> tuple[int, ...]:
    """The one shape of every row of a (nested) list column; a ragged one is a SpecError naming it."""
    array = column.combine_chunks()
    shape = []
    while _is_list(array.type):
        lengths = pc.list_value_length(array).unique().to_pylist()
        if len(lengths) != 1 or lengths[0] is None:
            known = sorted(x for x in lengths if x is not None)
            raise SpecError(f"{key}: column {name!r} is ragged in {_where(piece)}: its lists at depth {len(shape) + 1} "
                            f"have lengths {known[:5]}{'...' if len(known) > 5 else ''}; a tensor feature needs one "
                            f"shape in every row (pad or resize the rows when writing the data)")
        shape.append(int(lengths[0]))
        array = array.flatten()
    return tuple(shape)


def _check_leaf_values(found: Scan, info: Column, key: str) -> None:
    per_row = math.prod(info.shape)
    for piece, leaves in zip(found.pieces, found.leaf_values):
        values = leaves.get(info.name)
        if values is not None and values != piece.num_rows * per_row:
            raise SpecError(f"{key}: column {info.name!r} is ragged in {_where(piece)}: {values:,} values in "
                            f"{piece.num_rows:,} rows, not {per_row:,} per row (shape {list(info.shape)}, from the "
                            f"first row group); a tensor feature needs one shape in every row")


def check_images(info: DatasetInfo, decode: list, key: str = "data") -> None:
    """data.decode against the data: each named column is binary and its first value an image of the
    format named (read from the header of the first row group's first value; no decoding)."""
    from raytf import images

    columns = {c.name: c for c in info.features}
    for d in decode:
        column = columns[d.column]
        if column.dtype != "bytes":
            raise SpecError(f"data.decode: column {d.column!r} holds {column.dtype} values, not encoded images; decode "
                            f"binary columns only (PNG or JPEG bytes)")
        fs, root = _filesystem(info.root)
        values = _read_piece(fs, root, info.pieces[0], [d.column]).column(d.column)
        sample = next((v for v in values.to_pylist() if v is not None), None)
        found = images.header(sample) if sample is not None else None
        if found is None:
            raise SpecError(f"{key}: column {d.column!r} does not hold PNG or JPEG images (its first value starts "
                            f"{bytes(sample or b'')[:8]!r}); decode it in data.preprocess instead of data.decode")
        if found.format != d.format:
            raise SpecError(f"data.decode: column {d.column!r} holds {found.format.upper()} images (first value: "
                            f"{found.describe()}), not {d.format.upper()}; set format: {found.format}")


def inspect_report(path: str, workers: int = 2) -> str:
    """`raytf data inspect`: schema, rows, files, row groups and the split over `workers`."""
    found = scan(path, key=path)
    files = list(dict.fromkeys(p.file for p in found.pieces))
    sizes = [p.num_rows for p in found.pieces]
    lines = [f"{path}: {found.num_rows:,} rows in {len(files)} file(s), {len(sizes)} row group(s) "
             f"(rows per group: min {min(sizes):,}, max {max(sizes):,})", "", "schema:"]
    kinds = {}
    for field in found.schema:
        try:
            kinds[field.name] = _column_info(field, path)
        except SpecError:
            kinds[field.name] = None
    # binary columns and lists of unfixed length: sizes and shapes come from the first row group's rows
    sampled = [name for name, kind in kinds.items() if kind is not None and (-1 in kind.shape or kind.dtype == "bytes")]
    # vectors: whether the first row group's rows are one-hot (then a label for categorical_crossentropy)
    vectors = [name for name, kind in kinds.items()
               if kind is not None and len(kind.shape) == 1 and kind.dtype != "string"]
    if sampled or vectors:
        fs, root = _filesystem(path)
        first = _read_piece(fs, root, found.pieces[0], list(dict.fromkeys([*sampled, *vectors])))
    for field in found.schema:
        kind = kinds[field.name]
        if field.name in sampled:
            usable = _describe_sampled(kind, first.column(field.name), path, found.pieces[0])
        elif kind is None:
            usable = "not usable as a tensor"
        elif kind.dtype == "string":
            usable = "string" + (f" tensor{list(kind.shape)}" if kind.shape else "") + " (categorical)"
        else:
            usable = kind.dtype + (f" tensor{list(kind.shape)}" if kind.shape else "")
        if field.name in vectors and not usable.startswith("ragged"):
            usable += _one_hot_note(first.column(field.name))
        nulls = found.null_counts.get(field.name)
        lines.append(f"  {field.name}: {field.type} -> {usable}" + (f", {nulls:,} nulls" if nulls else ""))
    lines += ["", f"split over {workers} worker(s) (every row exactly once):"]
    for w, shard in enumerate(plan_shards(sizes, workers)):
        groups = len({s.piece for s in shard})
        lines.append(f"  worker {w}: {shard_rows(shard):,} rows from {groups} row group(s)")
    return "\n".join(lines)


DECODE_CHANNELS = {1: 1, 2: 1, 3: 3, 4: 4}  # an image's channels -> what data.decode offers (grey+alpha: grey)


def _one_hot_note(column: pa.ChunkedArray) -> str:
    """A vector column whose first row group's rows are one-hot (0/1, one 1 each): what it is as a label."""
    import numpy as np

    array = column.combine_chunks()
    if array.null_count or not len(array):
        return ""
    values = np.asarray(array.flatten().to_numpy(zero_copy_only=False), dtype=np.float64)
    width = len(values) // len(array)
    if width < 2 or len(values) != width * len(array):
        return ""
    rows = values.reshape(len(array), width)
    if not (np.isin(rows, (0.0, 1.0)).all() and (rows.sum(axis=1) == 1).all()):
        return ""
    return (f", one-hot over {width} classes in the first row group (as the label: loss categorical_crossentropy, "
            f"metric accuracy)")


def _describe_sampled(kind: Column, column: pa.ChunkedArray, key: str, piece: Piece) -> str:
    """A binary column's value sizes and its first value's image header; a list column's row shape."""
    from raytf import images

    if kind.dtype == "bytes":
        sizes = pc.binary_length(column).to_numpy(zero_copy_only=False)
        sample = next((v for v in column.to_pylist() if v is not None), None)
        image = images.header(sample) if sample is not None else None
        return (f"bytes (binary, {sizes.mean():,.0f} bytes per value on average, at most {sizes.max():,}); " +
                (f"first value: {image.describe()} image (data.decode: {{column: {kind.name}, format: "
                 f"{image.format}, channels: {DECODE_CHANNELS[image.channels]}}})" if image
                 else "first value: not a PNG or JPEG image"))
    try:
        return kind.dtype + f" tensor{list(_rows_shape(column, kind.name, key, piece))} (from the first row group)"
    except SpecError:
        return "ragged lists: not usable as a tensor"


def _read_piece(fs: pafs.FileSystem, root: str, piece: Piece, columns: list[str]) -> pa.Table:
    with fs.open_input_file(_join(root, piece.file)) as handle:
        return pq.ParquetFile(handle).read_row_group(piece.row_group, columns=columns)


# ---------------------------------------------------------------- reading (worker side)


def to_numpy(column: pa.ChunkedArray | pa.Array, info: Column):
    """Arrow column -> NumPy array of info.dtype, shape (n, *info.shape); no Python loop per row.
    Nulls take info.fill when the spec gives one, else they are an error naming the column."""
    import numpy as np

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
    while _is_list(values.type):
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
    table = _read_piece(fs, root, info.pieces[s.piece], names).slice(s.start, s.stop - s.start)
    try:
        return tuple(to_numpy(table.column(c.name), c) for c in (*info.features, info.label))
    except ValueError as exc:
        raise ValueError(f"{info.root}, {_where(info.pieces[s.piece])}: {exc}") from None


def iter_shard(info: DatasetInfo, root: str, shard: list[Slice], read_ahead: int = 2) -> Iterator[tuple]:
    """Yield (feature arrays..., label array) per slice of the shard, in order. Up to `read_ahead`
    row groups are read in background threads (pyarrow releases the GIL while it decodes)."""
    from concurrent.futures import ThreadPoolExecutor

    fs, root = _filesystem(root)
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
    import numpy as np

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
            for chunk in _shuffled(info, root, shard, shuffle_buffer, rng, shard_rows(shard)):
                sample = sample or chunk
                yield (*chunk, np.ones(len(chunk[-1]), np.float32))
            if epoch_rows > shard_rows(shard):
                yield _filler_rows(info, epoch_rows - shard_rows(shard), sample)
            epoch += 1
            continue
        needed = epoch_rows
        while needed > 0:  # a pass over the shard, again while the epoch needs more rows
            for chunk in _shuffled(info, root, shard, shuffle_buffer, rng, needed):
                needed -= len(chunk[-1])
                yield chunk
        epoch += 1


def _shuffled(info: DatasetInfo, root: str, shard: list[Slice], shuffle_buffer: int, rng, limit: int) -> Iterator[tuple]:
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
    import numpy as np

    if sample is not None and len(sample[-1]):
        return (*(np.repeat(column[:1], n, axis=0) for column in sample), np.zeros(n, np.float32))
    zeros = [np.full((n, *c.shape), b"", dtype=object) if c.tf_dtype == "string" else np.zeros((n, *c.shape), c.dtype)
             for c in (*info.features, info.label)]
    return (*zeros, np.zeros(n, np.float32))


def _permuted(window: list[tuple], rng, shuffle: bool, limit: int) -> tuple:
    """The window's rows as one chunk, permuted when shuffling, at most `limit` rows."""
    import numpy as np

    columns = [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*window)]
    n = len(columns[-1])
    if shuffle:
        perm = rng.permutation(n)[:limit]
        return tuple(c[perm] for c in columns)
    return tuple(c[:limit] for c in columns) if n > limit else tuple(columns)


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
        first_pass = lambda: _shuffled(info, root, shard, shuffle_buffer, np.random.default_rng([seed, first_epoch]),  # noqa: E731
                                       shard_rows(shard))
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


def padded_chunks(info: DatasetInfo, root: str, shard: list[Slice], total_rows: int) -> Iterator[tuple]:
    """Every row of the shard once, with weight 1, then weight-0 rows up to `total_rows`."""
    import numpy as np

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
