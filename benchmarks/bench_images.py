"""Images/s delivered to a training step by one worker's input pipeline, decode + augment included, side by
side in one run on the same JPEG images: raytf (Parquet binary column, data.decode + data.preprocess), a
TFRecord pipeline (TensorFlow's own format and reader: tf.train.Example, map(decode + augment), the usual
baseline) and Ray Data (read_parquet, iter_tf_batches, then the same decode + augment in TF on each batch).

    pip install -e . && python benchmarks/bench_images.py [--images 6000] [--size 64] [--reps 3]

Every pipeline decodes each JPEG and applies the same augmentation (pad by 4, random crop, random flip,
stateless ops), shuffles, and feeds batches of 128 to a trivial compiled step: the figure is what the
pipeline can feed. Target: raytf >= 0.9x TFRecord.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

BATCH = 128
SHUFFLE = 2048

AUGMENT = textwrap.dedent('''
    import tensorflow as tf

    def augment(example, training, seed):
        """The benchmark's preprocessing, shared by every pipeline: pad 4, random crop back, random flip."""
        image = tf.cast(example["image"], tf.float32) / 255.0
        size = tf.shape(image)[0]
        image = tf.image.resize_with_crop_or_pad(image, size + 8, size + 8)
        crop, flip = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        image = tf.image.stateless_random_crop(image, tf.stack([size, size, 3]), seed=crop)
        image = tf.image.stateless_random_flip_left_right(image, seed=flip)
        return {"image": image, "label": example["label"]}
''')


def make_images(count: int, size: int) -> tuple[list[bytes], np.ndarray]:
    """Noisy gradients with a bright square: JPEGs of a realistic size (a few KB at 64x64)."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    encoded, labels = [], rng.integers(0, 10, size=count)
    for k in labels:
        image = (np.stack([x, y, x + y], -1) * (255 / (2 * size)) + rng.normal(0, 25, (size, size, 3)))
        lo = rng.integers(0, size // 2)
        image[lo:lo + size // 4, lo:lo + size // 4] = 25 * k
        encoded.append(tf.io.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8), quality=90).numpy())
    return encoded, labels


def write_parquet(folder: Path, encoded, labels) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": pa.array(encoded, pa.binary()), "label": pa.array(labels.astype(np.int64))}),
                   folder / "images.parquet", row_group_size=1000)


def write_tfrecord(path: Path, encoded, labels) -> None:
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as writer:
        for image, label in zip(encoded, labels):
            feature = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
                       "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def consume(dataset, batches: int) -> float:
    """Images/s over `batches` batches fed to a trivial compiled step (after one warm-up batch)."""
    import tensorflow as tf

    @tf.function
    def step(x, y):
        return tf.reduce_sum(x) + tf.cast(tf.reduce_sum(y), tf.float32)

    it = iter(dataset)
    step(*next(it))
    started = time.perf_counter()
    for _ in range(batches):
        step(*next(it))
    return batches * BATCH / (time.perf_counter() - started)


def raytf_pipeline(folder: Path, batches: int) -> float:
    from raytf import data, data_scan
    from raytf.actor import pipelines
    from raytf.protocol import WorkerPayload
    from raytf.actor.examples import Examples
    from raytf.job import parse

    spec = parse({"name": "bench", "model": "m:f", "train": {"seed": 0},
                  "data": {"train": str(folder / "images.parquet"), "features": ["image"], "label": "label",
                           "decode": {"column": "image", "format": "jpeg", "channels": 3},
                           "preprocess": "bench_augment:augment"}})
    info = data_scan.read_info(str(folder / "images.parquet"), ["image"], "label")
    payload = WorkerPayload(spec, train_data=info, train_root=info.root)
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    ds = pipelines.train_dataset(info, info.root, shard, BATCH, info.num_rows // BATCH, SHUFFLE, seed=0,
                                 examples=Examples(payload, info, training=True))
    return consume(ds, batches)


def tfrecord_pipeline(path: Path, batches: int) -> float:
    import tensorflow as tf
    from bench_augment import augment

    schema = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(index, record):
        example = tf.io.parse_single_example(record, schema)
        example["image"] = tf.io.decode_jpeg(example["image"], channels=3)
        out = augment(example, True, tf.random.experimental.stateless_fold_in(tf.constant([0, 0], tf.int64), index))
        return out["image"], out["label"]

    ds = (tf.data.TFRecordDataset(str(path), num_parallel_reads=tf.data.AUTOTUNE).repeat().shuffle(SHUFFLE, seed=0)
          .enumerate().map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
          .batch(BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    return consume(ds, batches)


def ray_data_pipeline(folder: Path, batches: int) -> float:
    """Ray Data's documented path: read_parquet, iter_tf_batches; decode and augment each batch in TF."""
    import ray
    import tensorflow as tf
    from bench_augment import augment

    @tf.function
    def decode_batch(images, labels, first):
        def one(args):
            image, label, index = args
            out = augment({"image": tf.io.decode_jpeg(image, channels=3), "label": label}, True,
                          tf.random.experimental.stateless_fold_in(tf.constant([0, 0], tf.int64), index))
            return out["image"]
        indexes = first + tf.range(tf.shape(labels, out_type=tf.int64)[0], dtype=tf.int64)
        return tf.map_fn(one, (images, labels, indexes), fn_output_signature=tf.float32), labels

    def feed():
        seen = 0
        while True:
            ds = ray.data.read_parquet(str(folder / "images.parquet"))
            for b in ds.iter_tf_batches(batch_size=BATCH, drop_last=True, local_shuffle_buffer_size=SHUFFLE):
                yield decode_batch(b["image"], b["label"], tf.constant(seen, tf.int64))
                seen += BATCH

    return consume(feed(), batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-ray-data", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="raytf-images-"))
    (work / "bench_augment.py").write_text(AUGMENT)
    sys.path.insert(0, str(work))
    encoded, labels = make_images(args.images, args.size)
    write_parquet(work, encoded, labels)
    write_tfrecord(work / "images.tfrecord", encoded, labels)
    ways = {
        "TFRecord (tf.train.Example, map decode + augment)": lambda: tfrecord_pipeline(work / "images.tfrecord",
                                                                                      args.batches),
        "raytf Parquet (data.decode + data.preprocess)": lambda: raytf_pipeline(work, args.batches),
    }
    if not args.skip_ray_data:
        import ray

        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=os.cpu_count())
        ray.data.DataContext.get_current().enable_progress_bars = False
        ways["Ray Data iter_tf_batches (+ the same decode + augment)"] = lambda: ray_data_pipeline(work, args.batches)
    print(f"{args.images:,} JPEG images {args.size}x{args.size}x3 (~{np.mean([len(e) for e in encoded]) / 1024:.1f} KB "
          f"each), batch {BATCH}, shuffle {SHUFFLE}, {args.batches} batches per measure, median of {args.reps}, "
          f"{os.cpu_count()} CPUs")
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.reps):  # interleaved: machine drift hits every pipeline alike
        for name, fn in ways.items():
            rates[name].append(fn())
    med = {name: statistics.median(v) for name, v in rates.items()}
    base = med["TFRecord (tf.train.Example, map decode + augment)"]
    print("\n| pipeline | images/s | vs TFRecord |\n|---|---:|---:|")
    for name, rate in med.items():
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
