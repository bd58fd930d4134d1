"""A data set as the driver and the actors share it: its columns, its pieces (row groups), and the split of
its rows over the workers.

The driver describes a data set from Parquet metadata alone (raytf.data_scan); `plan_shards` splits its rows
over the workers (contiguous, balanced ranges, so every row belongs to exactly one worker); each worker
streams only its own row ranges (raytf.actor.shard_reader). Pure: no pyarrow, no TensorFlow, so the
protocol's types cost nothing to import.
"""
from __future__ import annotations

import dataclasses


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

    def describe(self) -> str:
        """Where in the data set, as messages name it: "row group 3 of part-0.parquet"."""
        return f"row group {self.row_group}" + (f" of {self.file}" if self.file else "")


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


# ---------------------------------------------------------------- sharding


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
