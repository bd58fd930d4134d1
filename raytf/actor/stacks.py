"""Where a task's process is, for a hang: every thread's Python stack and what the training thread was doing.

Asked by the driver when its watchdog finds a rank without progress (raytf.driver.hangs writes what this returns
into <output.dir>/hangs/). Pure but for `snapshot`, which reads this process's threads; no Ray, no TensorFlow.
A frame is the user's when its file is outside Python's and the installed packages' folders and outside raytf.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import threading
import traceback

Frame = tuple[str, int, str, str]  # file, line, function, source line

_RAYTF = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARIES = tuple({os.path.realpath(p) + os.sep for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                                           sysconfig.get_paths()["platlib"])})
_STORAGE = ("/raytf/checkpoint.py", "/raytf/storage.py", "/raytf/actor/uploads.py", "/pyarrow/fs.py", "/raytf/actor/export.py", "/h5py/")
_INPUT = ("/tensorflow/python/data/", "/raytf/actor/shard_reader.py", "/raytf/actor/pipelines.py",
          "/raytf/actor/inputs.py")
_TENSORFLOW = ("/tensorflow/python/eager/", "/tensorflow/python/distribute/", "/tensorflow/python/ops/")


def is_user(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    return not path.startswith(_RAYTF) and not path.startswith(_LIBRARIES) and "/site-packages/" not in path


def _is_raytf(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_RAYTF)


def where(frame: Frame) -> str:
    return f"{os.path.basename(frame[0])}:{frame[1]} in {frame[2]}"


def doing(stack: list[Frame]) -> tuple[str, str]:
    """What a thread is doing, from its stack (outermost first): ("user code" | "storage I/O" | "input" |
    "a TensorFlow step or collective" | "raytf", where). The innermost frame that says it decides (Python's own
    library frames, a lock's wait, say nothing): the user's own line, raytf's or pyarrow's storage calls, tf.data
    or raytf's readers, TensorFlow's execution of a step (its all-reduce waits there), raytf's other code; the
    user's or raytf's line that called into TensorFlow is the `where`."""
    for i in range(len(stack) - 1, -1, -1):
        name = stack[i][0].replace(os.sep, "/")
        if is_user(stack[i][0]):
            return "user code", where(stack[i])
        if any(mark in name for mark in _STORAGE):
            return "storage I/O", where(stack[i])
        if any(mark in name for mark in _INPUT):
            return "input", where(_caller(stack, i))
        if any(mark in name for mark in _TENSORFLOW):
            return "a TensorFlow step or collective", where(_caller(stack, i))
        if _is_raytf(stack[i][0]):  # raytf's own wait, not the user line that called it
            return "raytf", where(stack[i])
    return "raytf", where(stack[-1]) if stack else "?"


def _caller(stack: list[Frame], i: int) -> Frame:
    """The innermost user or raytf frame at or above `i`: the line that called into the library."""
    for j in range(i, -1, -1):
        if is_user(stack[j][0]) or _is_raytf(stack[j][0]):
            return stack[j]
    return stack[i]


def snapshot(training_thread: int | None) -> list[dict]:
    """Every thread of this process: its name, whether it runs the task's training, its stack."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue  # the thread answering this question
        stack = [(f.filename, f.lineno or 0, f.name, f.line or "") for f in traceback.extract_stack(frame)]
        # a thread Python did not start (tf.data runs a generator in one of TensorFlow's) has no name
        out.append({"thread": names.get(ident, f"native thread {ident}"), "training": ident == training_thread,
                    "stack": stack})
    out.sort(key=lambda t: not t["training"])
    return out


def summary(threads: list[dict]) -> tuple[str, str, list[str]]:
    """(doing, where) of the training thread, and where other threads are in user code (a generator feeding
    tf.data runs in a thread of TensorFlow's)."""
    training = next((t for t in threads if t["training"]), None)
    what, at = doing(training["stack"]) if training else ("not training", "")
    others = [f"{t['thread']}: {where(f)}" for t in threads if not t["training"]
              for f in [next((f for f in reversed(t["stack"]) if is_user(f[0])), None)] if f is not None]
    return what, at, others


def text(threads: list[dict]) -> str:
    """The stacks as Python prints them, the training thread first."""
    parts = []
    for t in threads:
        lines = "".join(traceback.format_list([traceback.FrameSummary(f, n, fn, line=src) for f, n, fn, src in t["stack"]]))
        parts.append(f"Thread {t['thread']}{' (training)' if t['training'] else ''}:\n{lines}")
    return "\n".join(parts)
