"""Shared fixtures: a self-contained job folder (model module + real digits Parquet) in a temp dir."""
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "jobs" / "data"

MODEL_MODULE = textwrap.dedent('''
    import keras

    def build_model():
        return keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dense(10)])

    not_a_function = 3
''')


def base_spec(**sections):
    spec = {
        "name": "t",
        "model": "tmodel:build_model",
        "data": {"train": "data/digits-train.parquet", "validation": "data/digits-test.parquet",
                 "features": ["pixels"], "label": "label"},
        "loss": {"name": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"name": "adam", "learning_rate": 0.01},
        "metrics": ["accuracy"],
        "train": {"epochs": 2, "global_batch_size": 64, "seed": 0},
        "cluster": {"workers": 2, "cpus_per_worker": 0.5, "reserve_timeout_s": 30},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


@pytest.fixture
def job_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("job")
    (folder / "tmodel.py").write_text(MODEL_MODULE)
    shutil.copytree(DIGITS, folder / "data", ignore=shutil.ignore_patterns("*.py"))
    return folder


def write_job(folder: Path, spec: dict, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(spec))
    return path
