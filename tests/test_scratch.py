"""A task's scratch folder and the sweep of those dead tasks left behind (raytf.actor.scratch): real
processes, a real temp dir; no Ray."""
import os
import subprocess
import sys
import time

import pytest

from raytf.actor import scratch

pytestmark = pytest.mark.timeout(60)

MAKE_ONE = "import sys; from raytf.actor import scratch; print(scratch.create(sys.argv[1]))"


def made_by_a_process_that_exited(root) -> str:
    """A scratch folder whose process is gone, as a task killed by ray.kill leaves it, with files inside."""
    path = subprocess.run([sys.executable, "-c", MAKE_ONE, str(root)], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    os.makedirs(os.path.join(path, "staging.cache"))
    with open(os.path.join(path, "staging.cache", "rows.data-00000"), "wb") as f:
        f.write(b"\0" * 4096)
    return path


def test_a_folder_names_its_process():
    assert scratch.owner(f"raytf-task-{os.getpid()}-a1_b2c3d") == os.getpid()
    assert scratch.owner("raytf-task-00wk_2sf") is None  # earlier raytf's names carry no owner: left alone
    assert scratch.owner("raytf-task-") is None and scratch.owner("other-123-x") is None


def test_the_sweep_removes_the_folders_of_dead_processes_only(tmp_path):
    dead = made_by_a_process_that_exited(tmp_path)
    mine = scratch.create(str(tmp_path))
    live = subprocess.Popen([sys.executable, "-c", MAKE_ONE + "; sys.stdout.flush(); sys.stdin.read()", str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = live.stdout.readline().strip()
        unowned = tmp_path / "raytf-task-00wk_2sf"  # no process id in its name
        unowned.mkdir()
        other = tmp_path / "somebody-else"
        other.mkdir()

        assert scratch.sweep(str(tmp_path)) == [dead]
        assert not os.path.exists(dead)
        assert all(os.path.isdir(p) for p in (mine, theirs, unowned, other))
    finally:
        live.stdin.close()
        live.wait(timeout=30)
    assert scratch.sweep(str(tmp_path)) == [theirs]  # once its process has exited


def test_with_a_grace_the_sweep_waits_for_processes_that_are_exiting(tmp_path):
    started = time.time()
    exiting = subprocess.Popen([sys.executable, "-c", MAKE_ONE + "; sys.stdout.flush(); import time; time.sleep(1.5)",
                                str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = exiting.stdout.readline().strip()
        assert scratch.sweep(str(tmp_path), grace_s=20, since=started) == [path]
        assert time.time() - started < 15
    finally:
        exiting.kill()
        exiting.wait(timeout=30)


def test_a_grace_does_not_wait_for_the_folders_of_older_live_processes(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", MAKE_ONE + "; sys.stdout.flush(); sys.stdin.read()", str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = live.stdout.readline().strip()
        began = time.time() + 1  # this session began after their folder was made
        assert scratch.sweep(str(tmp_path), grace_s=20, since=began) == []
        assert time.time() - began < 5 and os.path.isdir(theirs)
    finally:
        live.stdin.close()
        live.wait(timeout=30)
