"""A task's scratch folder and the sweep of those dead tasks left behind (raytf.actor.scratch): real
processes holding real locks in a real temp dir; no Ray."""
import os
import subprocess
import sys
import time

import pytest

from raytf.actor import scratch

pytestmark = pytest.mark.timeout(60)

# A task's process: makes its folder, says where, then lives until its stdin closes (or for argv[2] s).
TASK = """
import sys, time
from raytf.actor import scratch
folder = scratch.Scratch(sys.argv[1])
print(folder.path, flush=True)
time.sleep(float(sys.argv[2])) if len(sys.argv) > 2 else sys.stdin.read()
"""


def made_by_a_process_that_exited(root) -> str:
    """A scratch folder whose task is gone, as one killed by ray.kill leaves it, with a disk cache inside."""
    path = subprocess.run([sys.executable, "-c", TASK, str(root), "0"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    os.makedirs(os.path.join(path, "staging.cache"))
    with open(os.path.join(path, "staging.cache", "rows.data-00000"), "wb") as f:
        f.write(b"\0" * 4096)
    return path


def a_live_task(root, seconds: float | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", TASK, str(root), *([str(seconds)] if seconds else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_the_sweep_removes_the_folders_of_gone_tasks_only(tmp_path):
    dead = made_by_a_process_that_exited(tmp_path)
    mine = scratch.Scratch(str(tmp_path))
    live, theirs = a_live_task(tmp_path)
    try:
        unowned = tmp_path / "raytf-task-00wk_2sf"  # earlier raytf's folders have no owner file: left alone
        unowned.mkdir()
        other = tmp_path / "somebody-else"
        other.mkdir()

        assert scratch.sweep(str(tmp_path)) == [dead]
        assert not os.path.exists(dead)
        assert all(os.path.isdir(p) for p in (mine.path, theirs, unowned, other))
    finally:
        live.stdin.close()
        live.wait(timeout=30)
    assert scratch.sweep(str(tmp_path)) == [theirs]  # once its process has exited
    mine.remove()
    assert sorted(os.listdir(tmp_path)) == ["raytf-task-00wk_2sf", "somebody-else"]


def test_a_killed_task_is_gone_even_before_it_is_reaped(tmp_path):
    """SIGKILL, as ray.kill: no cleanup ran, the process is a zombie until its parent waits for it."""
    task, folder = a_live_task(tmp_path)
    task.kill()
    time.sleep(0.5)  # not waited for: a zombie
    try:
        assert scratch.sweep(str(tmp_path)) == [folder]
    finally:
        task.wait(timeout=30)


def test_with_a_grace_the_sweep_waits_for_tasks_that_are_exiting(tmp_path):
    started = time.time()
    exiting, folder = a_live_task(tmp_path, seconds=1.5)
    try:
        assert scratch.sweep(str(tmp_path), grace_s=20, since=started) == [folder]
        assert time.time() - started < 15
    finally:
        exiting.kill()
        exiting.wait(timeout=30)


def test_a_grace_does_not_wait_for_the_folders_of_older_live_tasks(tmp_path):
    live, theirs = a_live_task(tmp_path)
    try:
        began = time.time() + 1  # this session began after their folder was made
        assert scratch.sweep(str(tmp_path), grace_s=20, since=began) == []
        assert time.time() - began < 5 and os.path.isdir(theirs)
    finally:
        live.stdin.close()
        live.wait(timeout=30)
