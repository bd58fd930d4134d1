"""The driver's terminal is for raytf's own lines: what it is doing, progress, the summary, errors.

TensorFlow's C++ libraries write a few lines to the process's stderr while `import tensorflow` runs
(oneDNN, "Could not find cuda drivers", CPU features), before TF_CPP_MIN_LOG_LEVEL applies. The only way
to keep them off the terminal is at the file-descriptor level. TensorFlow may be imported at any time in
the driver's life (a spec's loss name, or unpickling an object of TensorFlow's that a worker sent), so the
console script filters fd 2 for the whole of its life (`filter_stderr`): fd 2 is a pipe, and a thread copies
every line that is not such noise to the real stderr as it comes; sys.stderr still says whether that is a
terminal. `native_noise_filtered` does the same for one block of library code (`raytf.fit` called from
Python). `-v/--verbose`, or a TF_CPP_MIN_LOG_LEVEL of the user's own, leaves stderr alone.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import select
import sys
import tempfile
import threading
from typing import Iterator

# absl's line format (`I0000 00:00:1796282571.561262    4290 port.cc:153] ...`), its pre-init notice, and
# the second line of TF's CPU-feature notice.
NATIVE_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
                          r"|[IWEF]\d{4} \d\d:\d\d:\S+\s+\d+ \S+:\d+\]"
                          r"|To enable the following instructions: .* rebuild TensorFlow)")


def hide_native_noise(verbose: bool) -> bool:
    """Whether to filter TensorFlow's import-time lines: not when asked for everything, nor when the user
    chose TensorFlow's log level themselves."""
    return not verbose and "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def without_noise(text: str) -> str:
    """`text` less the lines TensorFlow's native libraries print at import."""
    return "".join(line for line in text.splitlines(keepends=True) if not NATIVE_NOISE.match(line))


@contextlib.contextmanager
def native_noise_filtered(enabled: bool = True) -> Iterator[None]:
    """While the block runs, fd 2 is a temporary file; afterwards what is not native noise goes back to
    stderr (in order, errors and warnings of Python code included)."""
    if not enabled or _filter is not None:  # the whole process's stderr is filtered already
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = without_noise(captured.read().decode(errors="replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


# ---------------------------------------------------------------- the console script: its whole life

_filter: "_StderrFilter | None" = None
PARTIAL_WAIT_S = 0.05  # a line without its newline yet (the live progress line) is shown after this long


class _TerminalStderr(io.TextIOWrapper):
    """sys.stderr while fd 2 is the filter's pipe: it writes to fd 2 (so Python's and native lines stay in
    order) and answers isatty() for the real stderr, so a terminal still gets the live progress line."""
    tty = False

    def isatty(self) -> bool:
        return self.tty


class _StderrFilter:
    def __init__(self) -> None:
        sys.stderr.flush()
        self.terminal = os.dup(2)  # the real stderr
        self.read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self.python_stderr = sys.stderr
        stream = _TerminalStderr(io.FileIO(2, "w", closefd=False), encoding=getattr(sys.stderr, "encoding", None),
                                 errors="backslashreplace", line_buffering=True, write_through=True)
        stream.tty = os.isatty(self.terminal)
        sys.stderr = stream
        self.closing = threading.Event()
        self.wake_read, self.wake_write = os.pipe()  # stop() wakes the thread through this
        self.thread = threading.Thread(target=self._copy, name="raytf-stderr-filter", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        pending = b""
        while True:
            wait = PARTIAL_WAIT_S if pending or self.closing.is_set() else None
            try:
                ready = self.read_end in select.select([self.read_end, self.wake_read], [], [], wait)[0]
                chunk = os.read(self.read_end, 65536) if ready else b""
            except OSError:
                chunk, ready = b"", False
            if ready and chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                self._show(b"".join(line + b"\n" for line in lines))
                continue
            if pending:  # nothing more came: show the partial line as it is
                self._show(pending)
                pending = b""
            if (ready and not chunk) or self.closing.is_set():  # end of file, or stopping and drained
                return

    def _show(self, data: bytes) -> None:
        kept = without_noise(data.decode(errors="replace"))
        out = kept.encode(errors="replace")
        try:
            while out:
                out = out[os.write(self.terminal, out):]
        except OSError:  # the terminal went away: nothing to show it on
            pass

    def stop(self) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        sys.stderr = self.python_stderr
        os.dup2(self.terminal, 2)  # the pipe's last writer here is gone; children may still hold it
        self.closing.set()
        os.write(self.wake_write, b"x")
        self.thread.join(timeout=2.0)
        for fd in (self.read_end, self.wake_read, self.wake_write, self.terminal):
            os.close(fd)


def filter_stderr(verbose: bool) -> bool:
    """For the console script: from now until the process exits, the lines TensorFlow's native libraries
    print are kept off stderr (unless `hide_native_noise` says not to). Returns whether the filter is on.
    Only the process's own stderr is filtered: one a caller replaced (click's CliRunner, a notebook) is left be."""
    global _filter
    if _filter is not None:
        return True
    if not hide_native_noise(verbose) or sys.stderr is not sys.__stderr__ or sys.__stderr__ is None:
        return False
    _filter = _StderrFilter()
    atexit.register(stop_filtering_stderr)
    return True


def stop_filtering_stderr() -> None:
    """Restore stderr, after the lines still in the pipe are shown."""
    global _filter
    if _filter is not None:
        current, _filter = _filter, None
        current.stop()
