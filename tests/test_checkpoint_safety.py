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


def test_an_upload_whose_files_went_missing_fails_before_raytf_json_and_is_never_listed(tmp_path):
    """A background upload names the files written at the step boundary: a folder emptied under it (the task
    stopped meanwhile) fails the upload instead of leaving a 'complete' checkpoint with no state."""
    storage = Storage(str(tmp_path / "ckpts"))
    local = tmp_path / "local"
    local.mkdir()
    (local / "state.index").write_bytes(b"i")
    with pytest.raises(FileNotFoundError):
        storage.upload(str(local), meta(8), ["state.index", "state.data-00000-of-00001"])
    with pytest.raises(FileNotFoundError, match="holds no checkpoint files"):
        storage.upload(str(tmp_path / "local"), meta(16), [])
    assert storage.list() == [] and not (tmp_path / "ckpts" / "ckpt-000000000008" / META).exists()


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


def test_a_background_upload_takes_the_upload_off_the_step_path_and_raises_its_failure_in_the_training_thread(tmp_path, s3, monkeypatch):
    """checkpoint.background (the default): the chief's write_state returns once the state is on its disk while
    a slow S3 endpoint takes the upload (raytf.json last, as before: listed only once complete); the next
    checkpoint waits for it; a failed upload is raised in the training thread at the next wait. background: false uploads
    on the step path, as before."""
    import time

    import tensorflow as tf

    from raytf.actor.context import TaskContext
    from raytf.actor.loop import write_state
    from raytf.job import parse
    from tests.s3_server import FaultProxy

    proxy = FaultProxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    location = f"s3://{s3.bucket()}/ckpt"
    storage = Storage(location)
    state = tf.train.Checkpoint(w=tf.Variable(tf.zeros([64, 64])))  # 0.04 s a chunk: ~1 s an upload
    saved = {}

    def save(ctx, step):
        started = time.monotonic()
        write_state(state, storage, ctx, 2, lambda local: meta(step))
        saved[step] = time.monotonic() - started

    spec = {"name": "bg", "model": "m:f", "dataset_fn": "m:d", "train": {"global_batch_size": 8, "steps_per_epoch": 4}}
    ctx = TaskContext(0, 2, parse(spec), str(tmp_path))
    try:
        proxy.fault("slow", delay_s=0.04)
        save(ctx, 8)
        assert saved[8] < 0.3 and ctx.checkpoint_uploads.in_flight  # on its way while training goes on
        save(ctx, 16)  # waits for step 8's upload first
        assert saved[16] > 0.6
        ctx.checkpoint_uploads.complete()
        assert [c.step for c in storage.list()] == [8, 16] and ctx.channel.progress().checkpoint_s > 0.6
        inline = TaskContext(0, 2, parse({**spec, "checkpoint": {"background": False}}), str(tmp_path))
        save(inline, 24)
        assert saved[24] > 0.6 and [c.step for c in storage.list()] == [16, 24]  # uploaded and pruned to 2
        proxy.fault("pass")
        write_state(state, Storage(f"s3://no-such-bucket-{s3.bucket()}/ckpt"), ctx, 2, lambda local: meta(32))
        with pytest.raises(Exception, match="no-such-bucket"):  # the store's error, in the training thread
            ctx.checkpoint_uploads.complete()
    finally:
        proxy.close()
