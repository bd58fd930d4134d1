"""Synthetic Parquet data sets for tests, benchmarks and example jobs (no downloads).

`criteo_like` writes a click-through table shaped like Criteo's display-ads data: a 0/1 `label`,
13 dense count features `I1..I13` (int64, ~5% nulls) and 26 categorical features `C1..C26`
(8-hex-digit hashed strings). Labels follow a fixed logistic model of a few dense and categorical
features, so a model can learn them (AUC well above 0.5) and tests can check that it did.
`dense_table` writes a float32 table (a list<float> vector column or scalar columns) for ingest benchmarks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]


def _criteo_chunk(rng: np.random.Generator, rows: int, vocab: int) -> pa.Table:
    dense = rng.poisson(lam=np.linspace(1, 40, 13), size=(rows, 13)).astype(np.int64)
    cat_ids = rng.zipf(1.3, size=(rows, 26)) % vocab
    # A fixed "true" model: two dense counts and three categorical columns drive the click rate.
    logit = -1.2 + 0.08 * (dense[:, 0] - 1) - 0.02 * (dense[:, 5] - 15) + 0.9 * (cat_ids[:, 0] % 3 == 0) \
        - 0.7 * (cat_ids[:, 4] % 5 == 1) + 0.5 * (cat_ids[:, 9] % 2 == 0)
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    columns = {"label": pa.array(label)}
    nulls = rng.random((rows, 13)) < 0.05
    for j, name in enumerate(DENSE):
        columns[name] = pa.array(dense[:, j], mask=nulls[:, j])
    for j, name in enumerate(CATEGORICAL):
        hashed = np.char.mod("%08x", (cat_ids[:, j] * 2654435761 + j * 40503) % (2**32))
        columns[name] = pa.array(hashed.astype(object), pa.string())
    return pa.table(columns)


def criteo_like(out_dir: str | Path, rows: int, files: int = 4, row_group_size: int = 8192, vocab: int = 10_000,
                seed: int = 0) -> Path:
    """Write `rows` rows over `files` Parquet files (part-00000.parquet, ...) in out_dir; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = [rows // files + (1 if i < rows % files else 0) for i in range(files)]
    for i, n in enumerate(per_file):
        with pq.ParquetWriter(out / f"part-{i:05d}.parquet", _criteo_chunk(rng, 1, vocab).schema) as writer:
            done = 0
            while done < n:
                chunk = min(row_group_size, n - done)
                writer.write_table(_criteo_chunk(rng, chunk, vocab), row_group_size=row_group_size)
                done += chunk
    return out


def dense_table(path: str | Path, rows: int, width: int = 16, vector: bool = True, row_group_size: int = 65_536,
                seed: int = 0) -> Path:
    """float32 features (one list<float>[width] column `x`, or scalar columns x0..x{width-1}) and an int64 label."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    label = (x[:, 0] > 0).astype(np.int64)
    if vector:
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width), "label": label})
    else:
        table = pa.table({**{f"x{j}": x[:, j] for j in range(width)}, "label": label})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path
