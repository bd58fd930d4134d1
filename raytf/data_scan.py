"""The driver's look at a data set, from Parquet metadata (footers) before any actor starts: its files,
row groups and schema, the chosen columns checked (types, shapes, nulls, image formats), and
`raytf data inspect`'s report. Reads a row group's column only where a shape or an image header needs one.
"""
from __future__ import annotations

import dataclasses
import glob as globlib
import math
import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytf.data import Column, DatasetInfo, Piece, plan_shards, shard_rows
from raytf.errors import SpecError
from raytf.parquet_files import filesystem, is_list, join, read_piece


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


def _list_shape(t: pa.DataType) -> tuple[tuple[int, ...], pa.DataType] | None:
    """A (nested) list type's shape (-1 where rows may differ: read from the data) and its value type."""
    shape = []
    while is_list(t):
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
        return Column(field.name, _tensor_dtype(value_type), shape, values=_values_kind(value_type))
    if nested is not None and _is_text(nested[1]):  # e.g. tags: a fixed number of strings per row, (batch, n)
        return Column(field.name, "string", nested[0])
    raise SpecError(f"{key}: column {field.name!r} has type {t}, which raytf cannot make a tensor from; "
                    f"use numbers, (nested) lists of numbers or strings, tensors, strings or binary")


def _values_kind(t: pa.DataType) -> str:
    return "float" if pa.types.is_floating(t) else "integer"


def _tensor_dtype(t: pa.DataType) -> str:
    """A list or tensor column's dtype, as a number column's: integers int64 (ids above 2**24 stay exact, as
    float32 would not keep them), except uint8, which stays (images, a quarter of float32's memory); floats
    float32."""
    if pa.types.is_uint8(t):
        return "uint8"
    return "int64" if pa.types.is_integer(t) else "float32"


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
    fs, root = filesystem(path)
    files = _list_parquet_files(fs, root, key)
    pieces: list[Piece] = []
    leaves: list[dict[str, int]] = []
    schema = None
    nulls: dict[str, int] = {}
    for rel in files:
        full = join(root, rel)
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
        fs, root = filesystem(path)
        first = read_piece(fs, root, found.pieces[0], variable)
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


def _rows_shape(column: pa.ChunkedArray, name: str, key: str, piece: Piece) -> tuple[int, ...]:
    """The one shape of every row of a (nested) list column; a ragged one is a SpecError naming it."""
    array = column.combine_chunks()
    shape = []
    while is_list(array.type):
        lengths = pc.list_value_length(array).unique().to_pylist()
        if len(lengths) != 1 or lengths[0] is None:
            known = sorted(x for x in lengths if x is not None)
            raise SpecError(f"{key}: column {name!r} is ragged in {piece.describe()}: its lists at depth {len(shape) + 1} "
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
            raise SpecError(f"{key}: column {info.name!r} is ragged in {piece.describe()}: {values:,} values in "
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
        fs, root = filesystem(info.root)
        values = read_piece(fs, root, info.pieces[0], [d.column]).column(d.column)
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
        fs, root = filesystem(path)
        first = read_piece(fs, root, found.pieces[0], list(dict.fromkeys([*sampled, *vectors])))
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
