"""A lease on a run's output.dir in storage: one live attempt per output.dir across machines.

A flock on a local folder holds a run only on one machine; output.dir in a bucket is reached from many (a second
`raytf run` elsewhere, two overlapping attempts of one KubeRay RayJob). The lease is an object in output.dir,
`.raytf-lease.json`: who holds it (owner token, host, pid), until when (renewed every third of its time while the
run lives), and, once released, what the holder left behind (a staging folder whose results never got there).

A second driver is refused while the lease is live; it takes the lease over once it is released, expired, or held
by a process on this machine that no longer exists (a killed driver restarted on the same machine goes on at
once). An object store offers pyarrow no compare-and-set: a driver writes its lease, waits a moment and reads it
back; of two that wrote within that moment the last writer holds it and the other is refused.
"""
from __future__ import annotations

import copy
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from raytf.errors import RaytfError, SpecError
from raytf.storage import TIMEOUT_S, Folder

LEASE = ".raytf-lease.json"
# A holder that stops renewing (killed, cut off) frees the run after this long; a renewal (a read and a write,
# each under the storage deadline) fits in a third of it several times over.
TTL_S = max(60.0, 6 * TIMEOUT_S)
RELEASE_S = 5.0  # the release at the end, whatever ended the run: a stalled store does not hold the exit
SETTLE_S = 1.0  # between writing a lease and reading it back: a racing writer's lease shows by then


class LeaseHeld(SpecError):
    """Another live attempt holds the run (exit 2: the user picks another output.dir or waits)."""


class LeaseLost(RaytfError):
    """This attempt's lease was taken over (it stopped renewing for longer than its time)."""


def blocker(found: Any, host: str, now: float, pid_alive: Callable[[int], bool]) -> str | None:
    """Who holds the run, in words, if a lease record `found` keeps this driver out; None if it may take it (pure).
    Free: no record, a released one, an expired one, or one held by a process of this machine that is gone."""
    if not isinstance(found, dict) or found.get("released"):
        return None
    expires = found.get("expires")
    if not isinstance(expires, (int, float)) or expires <= now:
        return None
    pid = found.get("pid")
    if found.get("host") == host and isinstance(pid, int) and not pid_alive(pid):
        return None
    return (f"pid {pid} on {found.get('host')}, attempt started {found.get('started', '?')}, lease renewed until "
            f"{time.strftime('%H:%M:%S', time.localtime(expires))}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Lease:
    """This driver's hold on a run's output.dir in storage. `previous`: the record found before taking it (a
    released lease may name the staging folder of an attempt whose results never got there)."""

    def __init__(self, folder: Folder, previous: Any, record: dict[str, Any], ttl_s: float):
        self.folder, self.previous, self.record, self.ttl_s = folder, previous, record, ttl_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.lost: str | None = None  # who took it over, once that is known
        self._thread = threading.Thread(target=self._renew_loop, name="raytf-lease", daemon=True)

    @classmethod
    def acquire(cls, folder: Folder, name: str, ttl_s: float = TTL_S, settle_s: float = SETTLE_S) -> "Lease":
        """Take the run's lease, or LeaseHeld naming the holder. Renewed in the background until released."""
        host = socket.gethostname()
        found = folder.read_json(LEASE)
        held_by = blocker(found, host, time.time(), pid_alive)
        if held_by:
            raise LeaseHeld(_refusal(folder, held_by))
        record = {"owner": uuid.uuid4().hex, "name": name, "host": host, "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "expires": time.time() + ttl_s,
                  "released": False}
        folder.write_json(LEASE, record)
        time.sleep(settle_s)
        back = folder.read_json(LEASE)
        if not isinstance(back, dict) or back.get("owner") != record["owner"]:
            raise LeaseHeld(_refusal(folder, blocker(back, host, time.time(), pid_alive) or "a driver that "
                                     "started at the same moment"))
        lease = cls(folder, found, record, ttl_s)
        lease._thread.start()
        return lease

    def note(self, **fields: Any) -> None:
        """Record something in the lease at once (e.g. this attempt's staging folder); LeaseLost if another
        driver took the run over meanwhile (its record is never written over)."""
        with self._lock:
            if not self.holds():
                raise LeaseLost(f"output.dir {self.folder.where} was taken over by another run ({self.lost})")
            self.record.update(fields)
            self.folder.write_json(LEASE, self.record)

    def holds(self) -> bool:
        """Whether this driver still holds the lease, read from storage (before writing the run's results)."""
        if self.lost:
            return False
        found = self.folder.read_json(LEASE)
        if isinstance(found, dict) and found.get("owner") == self.record["owner"]:
            return True
        self.lost = blocker(found, "", 0.0, lambda pid: True) or "another driver"
        return False

    def release(self, **left: Any) -> None:
        """Give the run up (whatever ended it), recording what this attempt left behind, if anything. A store
        that cannot be written now leaves the lease to expire."""
        self._stop.set()
        if self.lost:
            return
        quick = copy.copy(self.folder)  # a store that stalled the run's end must not hold its exit long
        quick.timeout_s = min(self.folder.timeout_s, RELEASE_S)
        with self._lock:
            self.record.update(left, released=True, expires=time.time())
            try:
                found = quick.read_json(LEASE)
                if isinstance(found, dict) and found.get("owner") == self.record["owner"]:
                    quick.write_json(LEASE, self.record)
            except BaseException:  # noqa: BLE001 -- it lapses by itself; the run's own end is what gets reported
                pass

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with self._lock:
                    if self._stop.is_set() or not self.holds():
                        return
                    self.record["expires"] = time.time() + self.ttl_s
                    self.folder.write_json(LEASE, self.record)
            except Exception:  # noqa: BLE001 -- a store briefly away: try again next time, the lease has time left
                continue


def _refusal(folder: Folder, held_by: str) -> str:
    return (f"output.dir {folder.where} is in use by another run ({held_by}); wait for it to end, or give this run "
            f"another output.dir (--set output.dir=...)")
