"""The driver's terminal is for raytf's own lines: what it is doing, progress, the summary, errors.

TensorFlow's C++ libraries write a few lines to the process's stderr while `import tensorflow` runs
(oneDNN, "Could not find cuda drivers", CPU features), before TF_CPP_MIN_LOG_LEVEL applies. The only way
to keep them off the terminal is at the file-descriptor level: fd 2 goes to a temporary file while the
import runs, and every line that is not such noise is written back afterwards, so nothing else is lost.
`-v/--verbose`, or a TF_CPP_MIN_LOG_LEVEL of the user's own, leaves stderr alone.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
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
    if not enabled:
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
