"""Fixed-length list<string> columns (a row's tags, TF's parameter-server tutorial's 3-word feature) are
(batch, n) string tensors; ragged ones and null strings inside are refused naming the column."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytf import data, data_scan
from raytf.actor import pipelines, shard_reader
from raytf.errors import SpecError

WORDS = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]


def write_tags(path, rows=10, fixed=False, row_group_size=4):
    tags = [[WORDS[(i + k) % len(WORDS)] for k in range(3)] for i in range(rows)]
    kind = pa.list_(pa.string(), 3) if fixed else pa.list_(pa.string())
    pq.write_table(pa.table({"tags": pa.array(tags, kind), "label": list(range(rows))}), path,
                   row_group_size=row_group_size)
    return tags


@pytest.mark.parametrize("fixed", [False, True])
def test_a_list_of_strings_is_a_row_of_n_strings(tmp_path, fixed):
    tags = write_tags(tmp_path / "t.parquet", fixed=fixed)
    info = data_scan.read_info(str(tmp_path / "t.parquet"), ["tags"], "label")
    assert info.features[0].dtype == "string" and info.features[0].shape == (3,)
    rows = [r for chunk in shard_reader.iter_shard(info, str(tmp_path / "t.parquet"), data.plan_shards([4, 4, 2], 1)[0])
            for r in zip(*chunk)]
    assert [list(t) for t, _ in rows] == tags and [int(y) for _, y in rows] == list(range(10))
    report = data_scan.inspect_report(str(tmp_path / "t.parquet"))
    assert ("tags: fixed_size_list" if fixed else "tags: list") in report and "-> string tensor[3]" in report


def test_ragged_string_lists_and_null_strings_are_refused_naming_the_column(tmp_path):
    pq.write_table(pa.table({"tags": pa.array([["a"], ["b", "c"]], pa.list_(pa.string())), "label": [0, 1]}),
                   tmp_path / "ragged.parquet")
    with pytest.raises(SpecError, match=r"column 'tags' is ragged in row group 0: its lists at depth 1 have "
                                        r"lengths \[1, 2\]"):
        data_scan.read_info(str(tmp_path / "ragged.parquet"), ["tags"], "label")
    pq.write_table(pa.table({"tags": pa.array([["a", None], ["b", "c"]], pa.list_(pa.string())), "label": [0, 1]}),
                   tmp_path / "nulls.parquet")
    with pytest.raises(SpecError, match=r"column 'tags' has 1 null values"):  # from the footers, nothing read
        data_scan.read_info(str(tmp_path / "nulls.parquet"), ["tags"], "label")
    info = data_scan.read_info(str(tmp_path / "nulls.parquet"), ["tags"], "label", fill_nulls={"tags": ""})
    with pytest.raises(ValueError, match="column 'tags' has 1 null strings inside its lists"):
        next(shard_reader.iter_shard(info, str(tmp_path / "nulls.parquet"), data.plan_shards([2], 1)[0]))


def test_parameter_server_records_carry_string_lists_as_batch_by_n_string_tensors(tmp_path, monkeypatch):
    """A parameter-server worker's TFRecords (written from its shard, read back with TF ops only)."""
    tags = write_tags(tmp_path / "t.parquet", rows=12, fixed=True)
    info = data_scan.read_info(str(tmp_path / "t.parquet"), ["tags"], "label")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    assert pipelines.write_records(info, str(tmp_path / "t.parquet"), shard,
                                   str(tmp_path / "w" / pipelines.RECORDS_DIR / "t"), chunk_rows=5) == 12
    monkeypatch.chdir(tmp_path / "w")
    x, y = next(iter(pipelines.record_dataset(info, f"{pipelines.RECORDS_DIR}/t", batch_size=12, shuffle_buffer=0, seed=0)))
    assert x.dtype.name == "string" and x.shape == (12, 3)
    assert [[v.decode() for v in row] for row in x.numpy()] == tags and np.array_equal(y.numpy(), np.arange(12))


def test_mirrored_pipelines_give_batch_by_n_string_tensors(tmp_path):
    """A worker's pipeline under MultiWorkerMirrored (pyarrow into tf.data): training and validation."""
    tags = write_tags(tmp_path / "t.parquet", rows=12)
    info = data_scan.read_info(str(tmp_path / "t.parquet"), ["tags"], "label")
    shard = data.plan_shards([p.num_rows for p in info.pieces], 1)[0]
    x, y = next(iter(pipelines.train_dataset(info, str(tmp_path / "t.parquet"), shard, 4, 3, shuffle_buffer=0, seed=0)))
    assert x.dtype.name == "string" and x.shape == (4, 3) and [v.decode() for v in x.numpy()[0]] == tags[int(y[0])]
    batches = list(pipelines.eval_dataset(info, str(tmp_path / "t.parquet"), shard, 5, 3))  # 12 rows + 3 of padding
    assert [x.shape for x, _, _ in batches] == [(5, 3)] * 3 and sum(float(w.numpy().sum()) for *_, w in batches) == 12
