"""A data set's Parquet files wherever pyarrow.fs reaches them (a local path or a URI), and one row group
read from them: what the driver's scan (raytf.data_scan) and a worker's reader (raytf.actor.shard_reader)
both do.
"""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytf.data import Piece
from raytf.errors import SpecError


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem `path` is on and the path within it (a local path made absolute)."""
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
            raise SpecError(f"{path}: pyarrow cannot open this URI ({exc})") from None
    return pafs.LocalFileSystem(), os.path.abspath(path)


def join(root: str, rel: str) -> str:
    """A file of the data set: `rel` (as a Piece names it) under `root`; "" is the root itself."""
    return root if not rel else (rel if os.path.isabs(rel) else f"{root.rstrip('/')}/{rel}")


def read_piece(fs: pafs.FileSystem, root: str, piece: Piece, columns: list[str]) -> pa.Table:
    with fs.open_input_file(join(root, piece.file)) as handle:
        return pq.ParquetFile(handle).read_row_group(piece.row_group, columns=columns)


def is_list(t: pa.DataType) -> bool:
    """Whether a column of this type holds a list per row (of any list kind Arrow has)."""
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
