"""How the console script's process ends: a RaytfError as one line and its exit code, Ctrl-C and SIGTERM as
the same interrupted path (130, 143), and the exit itself."""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading

import click

from raytf.errors import RaytfError


class Terminated(KeyboardInterrupt):
    """SIGTERM (`ray job stop`, `raytf stop`, `kill`): the Ctrl-C path, exit 143 instead of 130."""


_signals: list[int] = []  # the signals received: Ray re-raises a KeyboardInterrupt of its own on the way out


def interrupt(signum, frame) -> None:
    _signals.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def exit_on_error(interrupted: str = "raytf: interrupted", verbose: bool = False):
    """A RaytfError becomes one line on stderr and its exit code (with -v, the failed task's traceback
    first); Ctrl-C exits 130 saying `interrupted`."""
    try:
        yield
    except RaytfError as exc:
        if verbose and exc.traceback:
            click.echo(exc.traceback.rstrip(), err=True)
        click.echo(f"raytf: error: {exc}", err=True)
        exit_process(exc.exit_code)
    except KeyboardInterrupt as exc:  # 128 + the signal, as shells report it
        terminated = isinstance(exc, Terminated) or signal.SIGTERM in _signals
        click.echo(interrupted + (" (SIGTERM)" if terminated else ""), err=True)
        exit_process(143 if terminated else 130)


def exit_process(code: int) -> None:
    """Exit with `code`. As the console script, without the interpreter's own teardown: its last garbage
    collection over TensorFlow's objects (the job's code imports it here) took ~1 s of every run's end. What a
    normal exit does first is done first: other threads joined, the exit hooks run (Ray's, logging's, MLflow's).
    Those are skipped too when a store call was abandoned (pyarrow's S3 client would wait for it without end)
    or the embedded Ray stopped under the driver (Ray's exit hook would wait on its GCS)."""
    # Only as the console script: in a host process (click's CliRunner, a test) an os._exit would end its host.
    if sys.stdout is not sys.__stdout__:
        sys.exit(code)
    from raytf import storage
    from raytf.driver import quiet

    abandoned = ("pyarrow" in sys.modules and storage.calls_abandoned()) or (
        "raytf.driver.session" in sys.modules and sys.modules["raytf.driver.session"].ray_abandoned())
    if not abandoned:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    quiet.stop_filtering_stderr()  # its lines still in the pipe reach the terminal first
    os._exit(code)
