"""Serving checks shared by the tests: a SavedModel called in a fresh interpreter with no raytf import,
the feed built from a Parquet file as raytf reads it, and saved_model_cli's view of it."""
import json
import subprocess
import sys
import textwrap

import numpy as np

from raytf import data


def feed_of(path: str, features: list[str], label: str, fill_nulls: dict | None = None) -> dict[str, np.ndarray]:
    """Every row of `path`'s feature columns as raytf feeds them (nulls filled, strings as bytes)."""
    import pyarrow.parquet as pq

    info = data.read_info(path, features, label, fill_nulls=fill_nulls)
    table = pq.read_table(path, columns=features)
    out = {}
    for column in info.features:
        values = data.to_numpy(table.column(column.name), column)
        out[column.name] = values.astype("S") if column.dtype in ("string", "bytes") else values
    return out


# Run in a fresh interpreter: TensorFlow only, no raytf, no Keras model code.
SERVE = textwrap.dedent('''
    import json, sys
    import numpy as np
    import tensorflow as tf
    path, inputs, out = sys.argv[1:4]
    served = tf.saved_model.load(path).signatures["serving_default"]
    feed = {k: tf.constant(v) for k, v in np.load(inputs, allow_pickle=False).items()}
    outputs = served(**feed)
    np.save(out, outputs["output"].numpy())
    print(json.dumps({"raytf_imported": any(m.split(".")[0] == "raytf" for m in sys.modules),
                      "inputs": sorted(served.structured_input_signature[1]), "outputs": sorted(outputs)}))
''')


def serve_in_a_fresh_process(saved_model: str, feed: dict, tmp_path) -> tuple[np.ndarray, dict]:
    inputs, out = tmp_path / "feed.npz", tmp_path / "served.npy"
    np.savez(inputs, **feed)
    proc = subprocess.run([sys.executable, "-c", SERVE, saved_model, str(inputs), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out), json.loads(proc.stdout.strip().splitlines()[-1])


def saved_model_cli(path: str) -> str:
    proc = subprocess.run(["saved_model_cli", "show", "--all", "--dir", path], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


