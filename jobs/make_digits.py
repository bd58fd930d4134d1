"""Regenerate jobs/data/digits-{train,test}.parquet from scikit-learn's bundled handwritten digits
(1,797 real 8x8 scans, UCI ML hand-written digits; no download). The files are committed, so running
jobs needs neither this script nor scikit-learn:  pip install -e '.[data]' && python jobs/make_digits.py
"""
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_digits


def write(path: Path, pixels: np.ndarray, labels: np.ndarray, row_group_size: int) -> None:
    flat = pa.array(pixels.astype(np.float32).reshape(-1))
    table = pa.table({"pixels": pa.FixedSizeListArray.from_arrays(flat, 64),
                      "label": pa.array(labels.astype(np.int64))})
    pq.write_table(table, path, row_group_size=row_group_size)


def main() -> None:
    digits = load_digits()
    pixels = digits.data / 16.0  # 0..16 intensities -> 0..1
    order = np.random.default_rng(0).permutation(len(pixels))
    pixels, labels = pixels[order], digits.target[order]
    test = 360
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    write(out / "digits-train.parquet", pixels[test:], labels[test:], row_group_size=256)
    write(out / "digits-test.parquet", pixels[:test], labels[:test], row_group_size=128)
    print(f"wrote {len(pixels) - test} train and {test} test rows to {out}")


if __name__ == "__main__":
    main()
