"""The chief's checkpoint uploads, off the step path (checkpoint.background): the training thread writes the
state to a local folder at the step boundary and trains on while one background thread uploads it to
checkpoint.dir (raytf.json last: a checkpoint is visible only once complete) and prunes.

One upload in flight: the next checkpoint waits for the one before (a slow store slows training instead of
piling up copies on the node's disk). A failed upload is raised in the training thread at the next
checkpoint or at the task's end, as an upload on the step path would have been at once. No TensorFlow here.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any


class Uploads:
    def __init__(self, channel=None):
        """channel: the task's (raytf.actor.channel.TaskChannel): a checkpoint's whole time (the state's write
        and its upload) when its upload is done, for the driver's drain deadline; "checkpointing" while the
        training thread waits for an upload, for the watchdog."""
        self.channel = channel
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, storage, local_dir: str, meta: dict[str, Any], keep: int, started: float) -> None:
        """Upload `local_dir` (removed afterwards) with raytf.json `meta`, then prune to `keep`; `started`: when
        the state's write began. Waits for the upload before, first."""
        self._wait()
        files = sorted(os.listdir(local_dir))  # as written now: the upload fails if any goes missing meanwhile

        def upload() -> None:
            try:
                storage.upload(local_dir, meta, files)
                storage.prune(keep)
                if self.channel is not None:
                    self.channel.checkpointed(time.time() - started)
            except BaseException as exc:  # raised in the training thread by the next wait
                self._error = exc
            finally:
                shutil.rmtree(local_dir, ignore_errors=True)

        self._thread = threading.Thread(target=upload, name="raytf-checkpoint-upload", daemon=True)
        self._thread.start()

    def complete(self) -> None:
        """Until the upload in flight, if any, is in checkpoint.dir (a drain's checkpoint, the task's end);
        raises its error if it failed."""
        waiting = self.in_flight
        if waiting and self.channel is not None:
            self.channel.phase("checkpointing")
        self._wait()
        if waiting and self.channel is not None:
            self.channel.phase("train")

    def settle(self, timeout_s: float) -> None:
        """The task failed or is being stopped: give the upload in flight up to `timeout_s` to finish (a
        complete checkpoint is one less interval to train again), and say nothing of its error."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        self._error = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
