"""Regenerate jobs/data/shapes-{train,test}.parquet: 32x32 RGB pictures of four shapes (circle, square,
triangle, cross) of random size, place and colours, each stored as PNG bytes in a binary column, the way
image sets usually sit in Parquet. Drawn here with NumPy and written with zlib: no download, no TensorFlow,
no Pillow. The files are committed, so running jobs needs neither this script nor anything it uses:
    python jobs/make_shapes.py
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SIZE = 32
CLASSES = ("circle", "square", "triangle", "cross")


def png(image: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of `image` [h, w, 3] uint8 (every row with filter type 0)."""
    height, width, _ = image.shape

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\x00" + image[y].tobytes() for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def mask(kind: int, rng: np.random.Generator) -> np.ndarray:
    """Where shape `kind` covers a SIZE x SIZE canvas, at a random size and place."""
    r = rng.uniform(5, 11)
    cy, cx = rng.uniform(r + 1, SIZE - r - 1, size=2)
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
    dy, dx = y - cy, x - cx
    if kind == 0:
        return dy ** 2 + dx ** 2 <= r ** 2
    if kind == 1:
        return (np.abs(dy) <= r * 0.8) & (np.abs(dx) <= r * 0.8)
    if kind == 2:  # apex up: inside the three edges
        return (dy <= r * 0.7) & (dy >= -r + 2 * np.abs(dx) * 0.9)
    arm = max(1.5, r * 0.3)
    return ((np.abs(dy) <= arm) & (np.abs(dx) <= r)) | ((np.abs(dx) <= arm) & (np.abs(dy) <= r))


def picture(kind: int, rng: np.random.Generator) -> np.ndarray:
    background = rng.integers(0, 256, size=3)
    foreground = (background + rng.integers(90, 166, size=3)) % 256  # always apart from the background
    image = np.empty((SIZE, SIZE, 3), np.uint8)
    image[:] = background
    image[mask(kind, rng)] = foreground
    return image


def write(path: Path, count: int, rng: np.random.Generator, row_group_size: int) -> None:
    labels = rng.integers(0, len(CLASSES), size=count)
    images = [png(picture(int(k), rng)) for k in labels]
    table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(labels.astype(np.int64))})
    pq.write_table(table, path, row_group_size=row_group_size)


def main() -> None:
    rng = np.random.default_rng(0)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    write(out / "shapes-train.parquet", 2400, rng, row_group_size=400)
    write(out / "shapes-test.parquet", 480, rng, row_group_size=240)
    print(f"wrote 2400 train and 480 test images ({', '.join(CLASSES)}) to {out}")


if __name__ == "__main__":
    main()
