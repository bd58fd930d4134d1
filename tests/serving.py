"""Serving checks shared by the tests: a SavedModel served the way TF Serving loads it, the TF1 session
loader (`tf.compat.v1.saved_model.loader.load` in a Session on a fresh Graph, then the serving signature's
tensors run), in this process or in a fresh interpreter with no raytf import; the feed built from a Parquet
file as raytf reads it; saved_model_cli's view of it.

`tf.saved_model.load` is lenient: it served SavedModels that TF Serving and `saved_model_cli run` could not
("Could not find variable ..."). Tests serve with `session_serve` or `serve_in_a_fresh_process`.

As a script, `python tests/serving.py SAVED_MODEL FEED.npz OUT.npz` serves FEED with TensorFlow only and
prints what it saw as JSON (what `serve_in_a_fresh_process` runs).
"""
import json
import os
import subprocess
import sys

import numpy as np


def session_serve(path: str, feed: dict, signature: str = "serving_default") -> tuple[dict[str, np.ndarray], dict]:
    """`feed` ({input name: array}) through `signature` of the SavedModel at `path`, as TF Serving runs it:
    ({output name: array}, {"inputs": the signature's input names, "outputs": its output names})."""
    import tensorflow as tf

    graph = tf.Graph()
    with tf.compat.v1.Session(graph=graph) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, [tf.saved_model.SERVING], path)
        served = meta.signature_def[signature]
        fetches = {name: graph.get_tensor_by_name(t.name) for name, t in served.outputs.items()}
        fed = {graph.get_tensor_by_name(served.inputs[name].name): value for name, value in feed.items()}
        outputs = session.run(fetches, feed_dict=fed)
    return outputs, {"inputs": sorted(served.inputs), "outputs": sorted(served.outputs)}


def feed_of(path: str, features: list[str], label: str, fill_nulls: dict | None = None) -> dict[str, np.ndarray]:
    """Every row of `path`'s feature columns as raytf feeds them (nulls filled, strings as bytes)."""
    import pyarrow.parquet as pq

    from raytf import data_scan
    from raytf.actor import shard_reader

    info = data_scan.read_info(path, features, label, fill_nulls=fill_nulls)
    table = pq.read_table(path, columns=features)
    out = {}
    for column in info.features:
        values = shard_reader.to_numpy(table.column(column.name), column)
        out[column.name] = values.astype("S") if column.dtype in ("string", "bytes") else values
    return out


def serve_in_a_fresh_process(saved_model: str, feed: dict, tmp_path) -> tuple[np.ndarray, dict]:
    """`session_serve` in a new interpreter that imports TensorFlow only (no raytf, no model code): the
    signature's `output`, and {"raytf_imported", "inputs", "outputs"}."""
    inputs, out = tmp_path / "feed.npz", tmp_path / "served.npz"
    np.savez(inputs, **feed)
    proc = subprocess.run([sys.executable, __file__, saved_model, str(inputs), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)["output"], json.loads(proc.stdout.strip().splitlines()[-1])


def saved_model_cli(path: str) -> str:
    proc = subprocess.run(["saved_model_cli", "show", "--all", "--dir", path], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _main(path: str, inputs: str, out: str) -> None:
    feed = dict(np.load(inputs, allow_pickle=False).items())
    outputs, info = session_serve(path, feed)
    np.savez(out, **outputs)
    print(json.dumps({"raytf_imported": any(m.split(".")[0] == "raytf" for m in sys.modules), **info}))


if __name__ == "__main__":
    here = os.path.dirname(os.path.realpath(__file__))
    # tests/ off the path: its modules (prometheus.py, data/, ...) must not stand in for what TensorFlow imports
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    _main(*sys.argv[1:4])
