"""An exception raised inside a task, turned into plain data the driver can show: its type, message, the
user's file:line and the whole traceback. Pure Python: no Ray, no TensorFlow.

The user's line is the deepest frame in a file of the job folder. Where that is not on the Python stack (an
error TensorFlow raises from a traced tf.function points at AutoGraph's generated files), it is the last
`File "...", line N` of the message that names a job file: TensorFlow lists the user's frames there.
"""
from __future__ import annotations

import os
import re
import traceback

from raytf.errors import RaytfError, TaskException

_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def user_line(frames: list[tuple[str, int]], message: str, job_roots: list[str]) -> str | None:
    """`file.py:LINE` (relative to the job folder) of the deepest frame in a job file, else of the last one
    the message names; None when neither names a job file. `job_roots`: where the job folder is seen from
    the task: its unpacked copy, and the driver's folder itself (a node of the driver's machine imports the
    job's modules from there, through the driver's sys.path that Ray hands its workers)."""
    roots = [os.path.realpath(r) for r in job_roots if r]

    def inside(path: str) -> str | None:
        if not os.path.isabs(path):  # "<frozen os>", "<string>": no file (and not relative to the cwd)
            return None
        real = os.path.realpath(path)
        for root in roots:
            if real.startswith(root + os.sep):
                rel = os.path.relpath(real, root)
                return None if rel.split(os.sep, 1)[0] in ("site-packages", "dist-packages") else rel
        return None

    for path, line in reversed(frames):
        rel = inside(path)
        if rel is not None:
            return f"{rel}:{line}"
    for path, line in reversed(_FILE_LINE.findall(message)):
        rel = inside(path)
        if rel is not None:
            return f"{rel}:{line}"
    return None


def capture(exc: BaseException, job_roots: list[str]) -> BaseException:
    """What to raise to the driver instead of `exc`: raytf's own errors as they are (the driver acts on their
    type), anything else as a TaskException that keeps the original type's name, so failures are still
    classified by it."""
    if isinstance(exc, RaytfError):
        return exc
    frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
    message = with_fix(str(exc))
    return TaskException(type(exc).__name__, message, user_line(frames, message, job_roots),
                         "".join(traceback.format_exception(exc)))


# Errors whose cause is known, and the fix, said in the error's first line (what the terminal shows).
KNOWN_FIXES = {
    "'ShardedVariable' object has no attribute 'handle'":
        "Keras 3 optimizers cannot update sharded variables (a variable_partitioner under parameter servers): "
        "run the script under train.keras: legacy (tf-keras), or drop the partitioner",
}


def with_fix(message: str) -> str:
    """`message` with the fix of a known cause added to its first line."""
    for cause, fix in KNOWN_FIXES.items():
        if cause in message:
            first, _, rest = message.partition("\n")
            return f"{first} ({fix})" + (f"\n{rest}" if rest else "")
    return message


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras 3 sets the key sentence of its errors in bold
_RAISED = re.compile(r"^\w+(Error|Exception): ")
_TF_PREAMBLE = ("Graph execution error", "in user code:", "Detected at node", "File ", "[[", "(most recent call last)")


def summary(message: str, limit: int = 500) -> str:
    """One line of an error message that names the cause: the first line, except where TensorFlow
    opens with "Graph execution error:" and a traceback, whose cause is the last plain line (before
    op lines such as `[[IteratorGetNext]]`)."""
    # A remote TF error carries the gRPC details after the cause; they are not it.
    message = _ANSI.sub("", message.split("\nAdditional GRPC error information")[0])
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    for i, line in enumerate(lines):  # Keras's "Arguments received by Dense.call():" and its bullets
        if line.startswith("Arguments received by"):
            lines = lines[:i]
            break
    if not lines:
        return ""
    # Keras 3 layer errors: "Exception encountered when calling Dense.call().", then the sentence that says
    # what is wrong ("Input 0 of layer ... is incompatible ..."), then "Arguments received" and bullets.
    for i, line in enumerate(lines[:-1]):
        if line.startswith("Exception encountered when calling"):
            return f"{line} {lines[i + 1]}"[:limit]
    if lines[0].startswith(_TF_PREAMBLE):
        plain = [line for line in lines if not line.startswith(_TF_PREAMBLE) and not line.endswith(":")]
        raised = [line for line in plain if _RAISED.match(line)]  # "ValueError: ...", where TF kept one
        return (raised[-1] if raised else plain[-1] if plain else lines[-1])[:limit]
    return _first_sentence(lines)[:limit]


def _first_sentence(lines: list[str]) -> str:
    """The first line, joined with the lines it runs on into (Keras wraps its sentences: "Object X was created
    by passing" / "non-serializable argument values ..., and therefore the object must override get_config()")."""
    said = lines[0]
    for line in lines[1:4]:
        ends_open = said[-1:].isalnum() or said.endswith((",", "`"))
        if not ends_open or not line[:1].islower():  # a sentence ended, or the next line is not its rest
            break
        said = f"{said} {line}"
    return said
