"""A checkpoint is never overwritten, and one that holds another model is never taken for a damaged one
(which the controller skips, training from scratch when none is left). Real TensorFlow checkpoints in this
process; no Ray."""
import json
import os

import pytest

from raytf.actor.channel import TaskChannel
from raytf.checkpoint import META, Storage
from raytf.errors import CheckpointCorrupt, CheckpointMismatch

pytestmark = pytest.mark.timeout(120)


def meta(step):
    return {"step": step, "epoch": 1, "step_in_epoch": step, "history": [], "world_size": 2}


def test_a_complete_checkpoint_is_never_written_into_and_an_incomplete_one_is_replaced(tmp_path):
    storage = Storage(str(tmp_path / "ckpts"))
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, blob in ((first, b"model A"), (second, b"model B")):
        folder.mkdir()
        (folder / "state.data-00000-of-00001").write_bytes(blob)
    path = storage.upload(str(first), meta(8))
    assert storage.upload(str(second), meta(8)) == path
    assert (tmp_path / "ckpts" / "ckpt-000000000008" / "state.data-00000-of-00001").read_bytes() == b"model A"
    # an upload cut short (no raytf.json) leaves a folder that the next save at that step replaces whole
    cut = tmp_path / "ckpts" / "ckpt-000000000016"
    cut.mkdir()
    (cut / "stale.index").write_bytes(b"half")
    storage.upload(str(second), meta(16))
    assert sorted(os.listdir(cut)) == [META, "state.data-00000-of-00001"]
    assert json.loads((cut / META).read_text())["step"] == 16
    # one cut short while it wrote raytf.json (empty, or half of it) is replaced too, never returned as complete
    for broken in (b"", b'{"step": 24, "ep'):
        half = tmp_path / "ckpts" / "ckpt-000000000024"
        half.mkdir(exist_ok=True)
        (half / META).write_bytes(broken)
        storage.upload(str(second), meta(24))
        assert json.loads((half / META).read_text())["step"] == 24
        assert (half / "state.data-00000-of-00001").read_bytes() == b"model B"
        assert [c.step for c in storage.list()] == [8, 16, 24]
        for name in os.listdir(half):
            os.remove(half / name)


class _Ctx:
    channel = TaskChannel(0)  # read_state says "restoring" into it


def saved(tmp_path, model, name):
    import tensorflow as tf

    from raytf.checkpoint import CheckpointInfo

    storage = Storage(str(tmp_path / name))
    local = tmp_path / f"{name}-local"
    tf.train.Checkpoint(model=model).write(str(local / "state"))
    path = storage.upload(str(local), meta(8))
    return CheckpointInfo(path=path, step=8, epoch=1, step_in_epoch=8), str(tmp_path / name)


def test_another_models_checkpoint_is_a_mismatch_naming_it_and_a_damaged_one_is_corrupt(tmp_path):
    import keras
    import tensorflow as tf

    from raytf.actor.loop import read_state

    def model(width):
        m = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(width), keras.layers.Dense(2)])
        return m

    info, location = saved(tmp_path, model(8), "a")
    read_state(tf.train.Checkpoint(model=model(8)), info, location, _Ctx())  # the same model restores
    with pytest.raises(CheckpointMismatch) as raised:
        read_state(tf.train.Checkpoint(model=model(16)), info, location, _Ctx())
    assert info.path in str(raised.value) and "another checkpoint.dir" in str(raised.value)
    assert "(8" in str(raised.value) or "8)" in str(raised.value), str(raised.value)  # the shapes are named
    # cut short on disk: damaged, which the controller answers with the checkpoint before
    data = [f for f in os.listdir(info.path) if f.startswith("state.data")][0]
    with open(os.path.join(info.path, data), "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointCorrupt):
        read_state(tf.train.Checkpoint(model=model(8)), info, location, _Ctx())
