"""Images and tensors from Parquet: binary (encoded image) and tensor columns, data.decode, data.preprocess
and data.cache, in tf.data on each worker (here in this process, no Ray); the cluster runs are in
tests/test_image_jobs.py."""
import struct
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytf import data, data_scan, images
from raytf.actor import pipelines, shard_reader
from raytf.errors import SpecError
from raytf.job import load, parse
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

sys.path.insert(0, str(REPO / "jobs"))
from make_shapes import png  # noqa: E402  (the job's own PNG writer: no Pillow here)

ROWS = 50


def picture(i: int) -> np.ndarray:
    """An 8x6 RGB picture whose pixels say which row it is: (i, i+1, i+2) everywhere."""
    image = np.empty((8, 6, 3), np.uint8)
    image[:] = (i, i + 1, i + 2)
    return image


def write_images(path, rows=ROWS, row_group_size=16):
    ids = np.arange(rows)
    tensors = pa.ExtensionArray.from_storage(
        pa.fixed_shape_tensor(pa.float32(), (4, 4, 1)),
        pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 16).astype(np.float32)), 16))
    nested = pa.array([[[float(i)] * 3] * 2 for i in ids], pa.list_(pa.list_(pa.float32())))
    table = pa.table({"image": pa.array([png(picture(int(i))) for i in ids], pa.binary()),
                      "tensor": tensors, "nested": nested, "id": pa.array(ids), "label": pa.array(ids % 3)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("img") / "images.parquet")


# ---------------------------------------------------------------- the driver side: no TensorFlow


def test_image_headers_say_format_size_and_channels():
    assert images.header(png(np.zeros((8, 6, 3), np.uint8))) == images.ImageHeader("png", 8, 6, 3)
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, 20, 30, 3) + b"\x00" * 9  # a baseline frame, 20x30, 3 comp.
    jpeg = b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9 + sof
    assert images.header(jpeg) == images.ImageHeader("jpeg", 20, 30, 3)
    assert images.header(b"not an image") is None and images.header(b"\x89PNG\r\n\x1a\n") is None


def test_binary_and_tensor_columns_get_their_shapes_from_the_schema(image_file):
    info = data_scan.read_info(str(image_file), ["image", "tensor", "nested"], "label")
    assert [(c.name, c.dtype, c.shape) for c in info.features] == [
        ("image", "bytes", ()), ("tensor", "float32", (4, 4, 1)), ("nested", "float32", (2, 3))]


def test_a_ragged_nested_list_is_a_spec_error_naming_the_column_and_the_row_group(tmp_path):
    rows = [[[1.0, 2.0]] * 2] * 4 + [[[1.0, 2.0], [3.0]]] + [[[1.0, 2.0]] * 2] * 3  # row 4: ragged
    pq.write_table(pa.table({"x": pa.array(rows, pa.list_(pa.list_(pa.float32()))), "y": list(range(8))}),
                   tmp_path / "ragged.parquet", row_group_size=4)
    with pytest.raises(SpecError, match=r"column 'x' is ragged in row group 1: 15 values in 4 rows, not 4 per row"):
        data_scan.read_info(str(tmp_path / "ragged.parquet"), ["x"], "y")
    pq.write_table(pa.table({"x": pa.array(rows[4:], pa.list_(pa.list_(pa.float32()))), "y": list(range(4))}),
                   tmp_path / "first.parquet")
    with pytest.raises(SpecError, match=r"column 'x' is ragged in row group 0: its lists at depth 2 have lengths \[1, 2\]"):
        data_scan.read_info(str(tmp_path / "first.parquet"), ["x"], "y")


def test_a_later_row_group_ragged_with_the_right_total_fails_when_read_naming_it(tmp_path):
    rows = [[[1.0, 2.0]] * 2] * 4 + [[[1.0], [2.0, 3.0, 4.0]]] + [[[1.0, 2.0]] * 2] * 3  # 4 values, wrong split
    path = tmp_path / "sly.parquet"
    pq.write_table(pa.table({"x": pa.array(rows, pa.list_(pa.list_(pa.float32()))), "y": list(range(8))}), path,
                   row_group_size=4)
    info = data_scan.read_info(str(path), ["x"], "y")  # the footers' counts agree: only reading can tell
    with pytest.raises(ValueError, match=r"row group 1: column 'x' is ragged: its lists at depth 2 have lengths 1..3"):
        list(shard_reader.iter_shard(info, str(path), data.plan_shards([4, 4], 1)[0]))


def test_inspect_shows_binary_and_tensor_columns(image_file):
    report = data_scan.inspect_report(str(image_file))
    assert "image: binary -> bytes (binary, " in report and "first value: png 8x6x3 image" in report
    assert "tensor: extension<arrow.fixed_shape_tensor" in report and "-> float32 tensor[4, 4, 1]" in report
    assert "nested: list<element: list<element: float>> -> float32 tensor[2, 3] (from the first row group)" in report


def image_spec(folder, **data_keys):
    return {"name": "img", "model": "imgmodel:build_model",
            "data": {"train": str(folder / "images.parquet"), "features": ["image", "tensor"], "label": "label",
                     **data_keys},
            "train": {"global_batch_size": 8, "seed": 3}, "cluster": {"workers": 2, "cpus_per_worker": 0.5}}


@pytest.mark.parametrize("keys, says", [
    ({"decode": {"column": "image", "format": "jpeg"}}, "holds PNG images (first value: png 8x6x3), not JPEG; set format: png"),
    ({"decode": {"column": "tensor", "format": "png"}}, "column 'tensor' holds float32 values, not encoded images"),
    ({"decode": {"column": "id", "format": "png"}}, "data.decode: column 'id' is not among data.features"),
    ({"cache": "disk", "remainder": "pad"}, "use remainder: drop with a cache"),
    ({"decode": {"column": "image", "format": "jpeg", "channels": 4}}, "JPEG has no alpha channel; use channels: 3"),
    ({"decode": []}, "data.features: ['image'] are binary (e.g. encoded images) and would reach the model as raw bytes"),
])
def test_decode_and_cache_mistakes_are_spec_errors_before_any_actor(image_file, keys, says):
    (image_file.parent / "imgmodel.py").write_text("def build_model():\n    pass\n")
    with pytest.raises(SpecError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load({**image_spec(image_file.parent, **keys), "base_dir": str(image_file.parent)}, check_code=False)


# ---------------------------------------------------------------- in tf.data (this process)

PREPROCESS = textwrap.dedent('''
    import tensorflow as tf

    def scale(example, training, seed):
        """Pixels to 0..1; for training, a random flip (stateless, raytf's seed) and +1 on the tensor column."""
        image = tf.cast(example["image"], tf.float32) / 255.0
        if training:
            image = tf.image.stateless_random_flip_left_right(image, seed=seed)
        return {**example, "image": image, "tensor": example["tensor"] + (1.0 if training else 0.0)}

    def noisy(example, seed):
        return {"image": tf.random.stateless_uniform([3], seed=seed), "label": example["label"]}

    def untraceable(example):
        return {"image": example["image"].numpy(), "label": example["label"]}

    def no_label(example):
        return {"image": example["image"]}
''')


@pytest.fixture(scope="module")
def tf_side(image_file):
    """The job folder on sys.path (as in an actor) and a payload builder."""
    (image_file.parent / "imgprep.py").write_text(PREPROCESS)
    sys.path.insert(0, str(image_file.parent))
    from raytf.protocol import WorkerPayload

    def payload(**data_keys):
        spec = parse(image_spec(image_file.parent, **{"decode": {"column": "image", "format": "png"}, **data_keys}))
        info = data_scan.read_info(str(image_file), ["image", "tensor", "id"], "label")
        return WorkerPayload(spec, train_data=info, train_root=str(image_file), val_data=info, val_root=str(image_file))

    yield payload
    sys.path.remove(str(image_file.parent))


def examples(payload, training=True):
    from raytf.actor.examples import Examples

    return Examples(payload, payload.train_data, training, cache_dir=None)


def validation_rows(payload, workers=2, batch=8):
    """Every worker's validation pass: (x, y, w) batches as NumPy."""
    info = payload.train_data
    out = []
    for w, shard in enumerate(data.plan_shards([p.num_rows for p in info.pieces], workers)):
        steps = -(-data.shard_rows(shard) // batch)
        ds = pipelines.eval_dataset(info, payload.train_root, shard, batch, steps, examples=examples(payload, False), worker=w)
        out += [(x, y.numpy(), wt.numpy()) for x, y, wt in ds]
    return out


def test_binary_and_tensor_columns_round_trip_every_row_once_with_their_shapes(tf_side):
    batches = validation_rows(tf_side())
    ids = []
    for x, y, w in batches:
        assert x["image"].shape[1:] == (8, 6, 3) and x["image"].dtype.name == "uint8"
        assert x["tensor"].shape[1:] == (4, 4, 1)
        real = w == 1
        rows = x["id"].numpy()[real]
        ids += list(rows)
        np.testing.assert_array_equal(x["image"].numpy()[real][:, 0, 0, 0], rows % 256)  # the right picture, decoded
        np.testing.assert_array_equal(x["tensor"].numpy()[real][:, 2, 3, 0], rows)
        np.testing.assert_array_equal(y[real], rows % 3)
    assert sorted(ids) == list(range(ROWS))  # every row once, over both workers; padding rows weigh 0


def test_preprocess_runs_per_example_with_training_off_for_validation(tf_side):
    payload = tf_side(preprocess="imgprep:scale")
    x, y, w = validation_rows(payload, workers=1)[0]
    assert x["image"].dtype.name == "float32" and float(np.max(x["image"])) <= 1.0
    np.testing.assert_array_equal(x["tensor"].numpy()[:, 0, 0, 0], x["id"].numpy())  # training=False: as stored
    info = payload.train_data
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    ds = pipelines.train_dataset(info, payload.train_root, shard, 8, 6, 0, 3, examples=examples(payload))
    x, y = next(iter(ds))
    np.testing.assert_array_equal(x["tensor"].numpy()[:, 0, 0, 0], x["id"].numpy() + 1)  # training=True: +1


def test_per_example_seeds_repeat_run_after_run_and_differ_between_workers(tf_side):
    payload = tf_side(preprocess="imgprep:noisy", cache="memory")
    info = payload.train_data
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]

    def first_batches(worker):
        ds = pipelines.train_dataset(info, payload.train_root, shard, 8, 6, 100, 3, examples=examples(payload), worker=worker)
        return np.concatenate([x.numpy() for x, _ in ds.take(12)])

    a, b = first_batches(0), first_batches(0)
    np.testing.assert_array_equal(a, b)  # the same augmentation, rebuilt from the spec
    assert not np.array_equal(a, first_batches(1))
    assert len({row.tobytes() for row in a}) == len(a)  # every example its own seed, passes included


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_a_cache_serves_every_row_once_per_pass_without_reading_the_files_again(tf_side, tmp_path, cache):
    import shutil

    moved = tmp_path / "images.parquet"
    shutil.copy(tf_side().train_root, moved)
    payload = tf_side(cache=cache)
    info = data_scan.read_info(str(moved), ["image", "tensor", "id"], "label")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    from raytf.actor.examples import Examples

    on_disk = tmp_path / "task.cache"
    ds = pipelines.train_dataset(info, str(moved), shard, 10, 5, 0, 3, worker=1,
                                 examples=Examples(payload, info, True, cache_dir=str(on_disk)))
    it = iter(ds)
    ids = [next(it)[0]["id"].numpy() for _ in range(5)]  # the first pass: reads the file, fills the cache
    moved.unlink()  # gone: the next passes come from the cache or not at all
    ids += [next(it)[0]["id"].numpy() for _ in range(10)]
    ids = np.concatenate(ids)
    for p in range(3):  # no shuffle: pass after pass, every row once
        assert sorted(ids[p * ROWS:(p + 1) * ROWS]) == list(range(ROWS))
    assert (cache == "disk") == any(f.name.startswith("train-1") for f in on_disk.glob("*"))


@pytest.mark.parametrize("function, says", [
    ("untraceable", r"data.preprocess imgprep:untraceable cannot run inside tf.data \(AttributeError: .*numpy.*\); "
                    r"it runs as a TensorFlow graph on every worker, so use TensorFlow ops only"),
    ("no_label", r"data.preprocess imgprep:no_label returned dict without the label 'label'"),
])
def test_a_preprocess_that_cannot_be_traced_is_a_clear_error_when_the_pipeline_is_built(tf_side, function, says):
    from raytf.actor.examples import PreprocessError

    payload = tf_side(preprocess=f"imgprep:{function}")
    shard = data.plan_shards([p.num_rows for p in payload.train_data.pieces], 1)[0]
    with pytest.raises(PreprocessError, match=says):
        pipelines.train_dataset(payload.train_data, payload.train_root, shard, 8, 6, 0, 3, examples=examples(payload))


def test_jpeg_columns_decode_too(tmp_path):
    import tensorflow as tf

    from raytf.protocol import WorkerPayload
    from raytf.actor.examples import Examples

    picture_ = np.zeros((16, 24, 3), np.uint8)
    picture_[:, :12] = 200
    encoded = tf.io.encode_jpeg(picture_, quality=95).numpy()
    assert images.header(encoded) == images.ImageHeader("jpeg", 16, 24, 3)
    pq.write_table(pa.table({"image": pa.array([encoded] * 4, pa.binary()), "label": [0, 1, 0, 1]}), tmp_path / "j.parquet")
    spec = parse({"name": "j", "model": "m:f", "data": {"train": str(tmp_path / "j.parquet"), "features": ["image"],
                  "label": "label", "decode": {"column": "image", "format": "jpeg", "channels": 1}}})
    info = data_scan.read_info(str(tmp_path / "j.parquet"), ["image"], "label")
    payload = WorkerPayload(spec, train_data=info, train_root=str(tmp_path / "j.parquet"))
    ds = pipelines.eval_dataset(info, payload.train_root, data.plan_shards([4], 1)[0], 4, 1,
                                examples=Examples(payload, info, False))
    x, y, w = next(iter(ds))
    assert x.shape == (4, 16, 24, 1) and abs(int(x[0, 0, 0, 0]) - 200) < 8 and int(x[0, 0, 23, 0]) < 8


def test_a_saved_model_takes_the_raw_columns_and_decodes_and_preprocesses_inside(tf_side, tmp_path):
    """What a TF Serving client sends is what the Parquet holds: PNG bytes; the SavedModel decodes and
    preprocesses each row as validation does, in a process with no raytf."""
    import keras
    import pyarrow.parquet as pq_

    from raytf.actor import export
    from tests.serving import feed_of, serve_in_a_fresh_process

    payload = tf_side(preprocess="imgprep:scale")
    inputs = {"image": keras.Input((8, 6, 3), name="image"), "tensor": keras.Input((4, 4, 1), name="tensor"),
              "id": keras.Input((), name="id", dtype="int64")}
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(inputs["image"]), keras.layers.Flatten()(inputs["tensor"]),
                                         keras.layers.Reshape((1,))(keras.ops.cast(inputs["id"], "float32"))])
    model = keras.Model(inputs, keras.layers.Dense(2)(joined))
    export.saved_model(model, payload.train_data.features, str(tmp_path / "sm"), payload)

    feed = feed_of(payload.train_root, ["image", "tensor", "id"], "label")
    served, info = serve_in_a_fresh_process(str(tmp_path / "sm"), feed, tmp_path)
    assert info["raytf_imported"] is False and info["inputs"] == ["id", "image", "tensor"]
    table = pq_.read_table(payload.train_root)
    rows = tuple(shard_reader.to_numpy(table.column(c.name), c) for c in (*payload.train_data.features, payload.train_data.label))
    expected = keras.ops.convert_to_numpy(model(examples(payload, False).model_input(rows), training=False))
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
