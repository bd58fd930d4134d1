"""Sharding covers every row exactly once; describe() rejects bad data before training; the worker-side
pipeline yields exactly the planned rows."""
import itertools
import random
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytf import data, data_scan
from raytf.actor import pipelines, shard_reader
from raytf.errors import SpecError


def covered_rows(piece_rows, shards):
    starts = list(itertools.accumulate([0, *piece_rows]))
    return [[starts[s.piece] + r for s in shard for r in range(s.start, s.stop)] for shard in shards]


def layouts():
    yield from [([], 1), ([5], 3), ([1], 4), ([0, 0, 3], 2), ([7, 1, 1, 1], 3), ([100], 1), ([3, 3], 6)]
    rng = random.Random(0)
    for _ in range(200):
        pieces = [rng.choice([0, 1, 2, 7, 64, 1000]) for _ in range(rng.randint(1, 9))]
        yield pieces, rng.randint(1, 9)


@pytest.mark.parametrize("piece_rows,workers", list(layouts()))
def test_every_row_lands_in_exactly_one_shard_and_shards_are_balanced(piece_rows, workers):
    shards = data.plan_shards(piece_rows, workers)
    assert len(shards) == workers
    rows = covered_rows(piece_rows, shards)
    flat = [r for shard in rows for r in shard]
    assert sorted(flat) == list(range(sum(piece_rows)))  # the union is the data set, no row twice
    sizes = [len(r) for r in rows]
    assert max(sizes) - min(sizes) <= 1
    for shard in shards:
        assert all(0 <= s.start < s.stop <= piece_rows[s.piece] for s in shard)


def test_no_workers_is_an_error():
    with pytest.raises(ValueError):
        data.plan_shards([10], 0)


@pytest.fixture
def dataset_dir(tmp_path):
    """Three files with uneven row groups: 10 rows (groups of 4), 3 rows, 25 rows (groups of 7)."""
    folder = tmp_path / "ds"
    folder.mkdir()
    start = 0
    for i, (rows, group) in enumerate([(10, 4), (3, 3), (25, 7)]):
        ids = np.arange(start, start + rows)
        vec = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 3).astype(np.float32)), 3)
        pq.write_table(pa.table({"x": ids.astype(np.float64), "vec": vec, "y": ids}), folder / f"part-{i}.parquet",
                       row_group_size=group)
        start += rows
    (folder / "_SUCCESS").write_text("")  # marker files are skipped
    return folder


def test_describe_reads_row_groups_and_column_types_from_metadata(dataset_dir):
    info = data_scan.read_info(str(dataset_dir), ["x", "vec"], "y")
    assert info.num_rows == 38
    assert [p.num_rows for p in info.pieces] == [4, 4, 2, 3, 7, 7, 7, 4]
    assert info.files == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert info.features == (data.Column("x", "float32"), data.Column("vec", "float32", (3,)))
    assert info.label == data.Column("y", "int64")


@pytest.mark.parametrize("path,features,label,message", [
    ("missing", ["x"], "y", "does not exist"),
    ("ds", ["nope"], "y", "column(s) ['nope'] not in"),
    ("ds/part-*.parquet", ["x"], "nope", "column(s) ['nope'] not in"),
    ("ds/none-*.parquet", ["x"], "y", "matches no files"),
])
def test_bad_data_is_a_spec_error_naming_the_problem(tmp_path, dataset_dir, path, features, label, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        data_scan.read_info(str(tmp_path / path), features, label)


def test_empty_and_unconvertible_data_are_spec_errors(tmp_path):
    pq.write_table(pa.table({"x": pa.array([], pa.float32()), "y": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    with pytest.raises(SpecError, match="has no rows"):
        data_scan.read_info(str(tmp_path / "empty.parquet"), ["x"], "y")
    pq.write_table(pa.table({"s": pa.array([{"a": 1}, {"a": 2}]), "y": [0, 1]}), tmp_path / "struct.parquet")
    with pytest.raises(SpecError, match="column 's' has type struct"):
        data_scan.read_info(str(tmp_path / "struct.parquet"), ["s"], "y")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(SpecError, match="not a readable Parquet file"):
        data_scan.read_info(str(tmp_path / "junk.parquet"), ["x"], "y")


def test_worker_pipelines_read_each_row_once_across_workers(dataset_dir):
    info = data_scan.read_info(str(dataset_dir), ["x", "vec"], "y")
    workers, batch = 3, 4
    shards = data.plan_shards([p.num_rows for p in info.pieces], workers)
    seen = []
    for shard in shards:
        steps = -(-data.shard_rows(shard) // batch)
        for x, y, w in pipelines.eval_dataset(info, str(dataset_dir), shard, batch, steps):
            y, w = y.numpy(), w.numpy()
            assert np.array_equal(x["vec"].numpy()[w > 0][:, 0], y[w > 0])  # columns stay aligned
            seen.extend(y[w > 0].tolist())
    assert sorted(seen) == list(range(38))


def test_train_pipeline_gives_exactly_the_planned_batches_per_epoch_reshuffled_each_epoch(dataset_dir):
    info = data_scan.read_info(str(dataset_dir), ["x"], "y")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 2)[0]  # 19 rows
    def epochs(seed, count=3):
        batches = [y.numpy().tolist() for _, y in pipelines.train_dataset(info, str(dataset_dir), shard, 4, 4,
                                                                           shuffle_buffer=100, seed=seed).take(4 * count)]
        return [sum(batches[i * 4:(i + 1) * 4], []) for i in range(count)]
    first, again, other = epochs(1), epochs(1), epochs(2)
    assert first == again and first != other  # deterministic per seed
    for rows in first:  # each epoch: 16 distinct rows of the shard, the 3-row remainder dropped
        assert len(rows) == 16 and len(set(rows)) == 16 and set(rows) <= set(range(19))
    assert first[0] != first[1]  # reshuffled per epoch


@pytest.mark.parametrize("shuffle_buffer", [0, 5, 1000])
def test_an_epoch_longer_than_the_shard_rereads_it(dataset_dir, shuffle_buffer):
    info = data_scan.read_info(str(dataset_dir), ["x"], "y")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 2)[1]  # 19 rows: 19..37
    chunks = shard_reader.epoch_chunks(info, str(dataset_dir), shard, 30, shuffle_buffer, seed=0)
    rows = []
    while len(rows) < 60:
        rows.extend(next(chunks)[-1].tolist())
    assert len(rows) == 60  # chunks never cross an epoch boundary
    for epoch in (rows[:30], rows[30:]):
        counts = {r: epoch.count(r) for r in set(epoch)}
        assert set(counts) == set(range(19, 38)) and max(counts.values()) == 2  # the whole shard, then 11 again
    if shuffle_buffer == 0:
        assert rows[:19] == list(range(19, 38))  # no shuffle: file order


def test_nulls_are_reported_with_the_column_name():
    with pytest.raises(ValueError, match="column 'x' has 1 null"):
        shard_reader.to_numpy(pa.array([1.0, None]), data.Column("x", "float32"))


def test_integer_id_lists_stay_exact_integers(tmp_path):
    """Hashed ids above 2**24 (float32 has 24 bits of mantissa) in list and tensor columns arrive as int64,
    as a scalar int column does; uint8 images stay uint8 and float lists float32."""
    big = 2**24 + 1  # float32(16777217) == 16777216
    ids = pa.array([[big, big + 2], [3, 4]], pa.list_(pa.int64(), 2))
    tensor = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.int32(), (2,)),
                                            pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4], pa.int32()), 2))
    table = pa.table({"ids": ids, "tensor": tensor, "pixels": pa.array([[1, 2], [3, 4]], pa.list_(pa.uint8(), 2)),
                      "vec": pa.array([[0.5, 1.5], [2.5, 3.5]], pa.list_(pa.float64())), "y": [0, 1]})
    pq.write_table(table, tmp_path / "ids.parquet")
    info = data_scan.read_info(str(tmp_path / "ids.parquet"), ["ids", "tensor", "pixels", "vec"], "y")
    assert [(c.name, c.dtype) for c in info.features] == [("ids", "int64"), ("tensor", "int64"), ("pixels", "uint8"),
                                                          ("vec", "float32")]
    read = shard_reader.to_numpy(table.column("ids"), info.features[0])
    assert read.dtype == np.int64 and read.tolist() == [[big, big + 2], [3, 4]]


def test_globs_and_file_uris_find_the_same_rows(dataset_dir):
    by_dir = data_scan.read_info(str(dataset_dir), ["x"], "y")
    by_glob = data_scan.read_info(str(dataset_dir / "part-*.parquet"), ["x"], "y")
    by_uri = data_scan.read_info(f"file://{dataset_dir}", ["x"], "y")
    assert by_dir.num_rows == by_glob.num_rows == by_uri.num_rows == 38
    assert len(by_glob.pieces) == len(by_uri.pieces) == 8


def test_files_with_different_schemas_are_refused(tmp_path):
    pq.write_table(pa.table({"x": [1.0], "y": [0]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": [1.0], "z": [0]}), tmp_path / "b.parquet")
    with pytest.raises(SpecError, match=r"different schema .* \['y', 'z'\]"):
        data_scan.read_info(str(tmp_path), ["x"], "y")


@pytest.fixture
def criteo_dir(tmp_path):
    from raytf.synthetic import criteo_like

    return criteo_like(tmp_path / "criteo", rows=3000, files=3, row_group_size=500)


def test_nulls_are_found_from_metadata_before_training_and_filled_when_asked(criteo_dir):
    with pytest.raises(SpecError, match=r"column 'I1' has [\d,]+ null values; set data.fill_nulls: \{I1: <value>\}"):
        data_scan.read_info(str(criteo_dir), ["I1", "C1"], "label")
    info = data_scan.read_info(str(criteo_dir), ["I1", "C1"], "label", fill_nulls={"I1": -1})
    assert info.features[0].fill == -1 and info.features[1].dtype == "string"
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    i1, c1, label = (np.concatenate(parts) for parts in zip(*shard_reader.iter_shard(info, str(criteo_dir), shard)))
    assert len(i1) == 3000 and (i1 == -1).sum() > 50  # ~5% nulls, now -1
    assert c1.dtype == object and all(len(v) == 8 for v in c1[:20])  # hashed 8-hex-digit categories
    assert set(np.unique(label)) == {0, 1}


def test_strings_reach_tensorflow_as_tf_string(criteo_dir):
    import tensorflow as tf

    info = data_scan.read_info(str(criteo_dir), ["C1", "C2"], "label")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 2)[0]
    x, y = next(iter(pipelines.train_dataset(info, str(criteo_dir), shard, 32, 4, shuffle_buffer=100, seed=0)))
    assert x["C1"].dtype == tf.string and x["C1"].shape == (32,) and y.shape == (32,)


def test_pad_mode_gives_every_row_once_per_epoch_with_weights(dataset_dir):
    info = data_scan.read_info(str(dataset_dir), ["x"], "y")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 2)[0]  # 19 rows
    ds = pipelines.train_dataset(info, str(dataset_dir), shard, 4, 5, shuffle_buffer=100, seed=3, pad=True)
    batches = list(ds.take(10))  # two epochs of 5 batches
    for epoch in (batches[:5], batches[5:]):
        y = np.concatenate([b[1].numpy() for b in epoch])
        w = np.concatenate([b[2].numpy() for b in epoch])
        assert sorted(y[w > 0].tolist()) == list(range(19)) and (w == 0).sum() == 1


def test_inspect_report_shows_schema_rows_and_the_split(criteo_dir):
    report = data_scan.inspect_report(str(criteo_dir), workers=4)
    assert "3,000 rows in 3 file(s), 6 row group(s)" in report
    assert "C1: string -> string (categorical)" in report and "I1: int64 -> int64" in report and "nulls" in report
    assert report.count("750 rows") == 4


def test_cli_data_commands(tmp_path):
    from click.testing import CliRunner

    from raytf.cli import main

    made = CliRunner().invoke(main, ["data", "synth-criteo", str(tmp_path / "c"), "--rows", "1000", "--files", "2"])
    assert made.exit_code == 0 and "wrote 1,000 rows in 2 file(s)" in made.output
    shown = CliRunner().invoke(main, ["data", "inspect", str(tmp_path / "c"), "-n", "3"])
    assert shown.exit_code == 0 and "1,000 rows in 2 file(s)" in shown.output and "worker 2: 334 rows" in shown.output
    missing = CliRunner().invoke(main, ["data", "inspect", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_parameter_server_records_hold_each_workers_shard_and_read_back_with_tf_ops_only(dataset_dir, tmp_path,
                                                                                        monkeypatch):
    info = data_scan.read_info(str(dataset_dir), ["x", "vec"], "y")
    shards = data.plan_shards([p.num_rows for p in info.pieces], 2)
    for i, shard in enumerate(shards):  # as each worker actor does, in its own folder
        written = pipelines.write_records(info, str(dataset_dir), shard,
                                          str(tmp_path / f"w{i}" / pipelines.RECORDS_DIR / "t"), chunk_rows=3)
        assert written == data.shard_rows(shard)
    seen = []
    for i, shard in enumerate(shards):
        monkeypatch.chdir(tmp_path / f"w{i}")  # the pipeline reads a relative path, like on a worker
        rows = data.shard_rows(shard)
        ds = pipelines.record_dataset(info, f"{pipelines.RECORDS_DIR}/t", batch_size=rows, shuffle_buffer=0, seed=0)
        assert not any("PyFunc" in op for op in _dataset_ops(ds))  # runnable on a remote TF worker
        (x, y), again = list(ds.take(2))[0], list(ds.take(2))[1]
        assert np.array_equal(x["vec"].numpy()[:, 0], y.numpy())  # columns stay aligned
        assert np.array_equal(again[1].numpy(), y.numpy())  # endless: the next pass follows
        seen.extend(y.numpy().tolist())
        shuffled = pipelines.record_dataset(info, f"{pipelines.RECORDS_DIR}/t", batch_size=rows, shuffle_buffer=100, seed=0)
        batches = [b[1].numpy().tolist() for b in shuffled.take(4)]
        # the shuffle buffer spans passes (the stream has no epochs): rows of the shard only, all of them, mixed
        assert set(sum(batches, [])) == set(y.numpy().tolist()) and batches[0] != sorted(batches[0])
    assert sorted(seen) == list(range(38))  # every row in exactly one worker's records
    with pytest.raises(ValueError, match="shard has no rows"):
        pipelines.write_records(info, str(dataset_dir), [], str(tmp_path / "empty"))


def _dataset_ops(ds):
    """The op types of a dataset's graph (functions included)."""
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef.FromString(ds._as_serialized_graph().numpy())
    return [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]
