"""A run's attempts: each start of `raytf run` on a run's storage is one, recorded in result.json, so that a
run started again on a new cluster (resume: auto) says where and when it trained and why each try ended.

Pure: the driver reads the earlier result.json (raytf.storage) and passes it in.
"""
from __future__ import annotations

import socket
import time
from typing import Any

LOST = ("lost: the driver ended without writing the run's end (killed, its cluster gone, or its storage unreachable "
        "at the end)")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def succeeded(previous: dict[str, Any] | None, name: str) -> bool:
    """Whether `previous` (an earlier result.json) is this run, finished."""
    return bool(previous) and previous.get("name") == name and previous.get("status") == "succeeded"


def carried(previous: dict[str, Any] | None, name: str) -> list[dict[str, Any]]:
    """The attempts of the earlier run this one continues; one that never wrote its end is marked lost."""
    if not previous or previous.get("name") != name:
        return []
    found = [dict(a) for a in previous.get("attempts") or [] if isinstance(a, dict)]
    for attempt in found:
        if not attempt.get("ended"):
            attempt["ended_because"] = LOST
    return found


def begin(number: int, cluster: dict[str, Any], resumed_from_step: int | None) -> dict[str, Any]:
    """This attempt, as it starts."""
    return {"attempt": number, "cluster": cluster, "host": socket.gethostname(), "started": now(),
            "resumed_from_step": resumed_from_step, "ended": None, "ended_because": None}


def end(attempt: dict[str, Any], status: str, error: str | None) -> None:
    """Close `attempt` with the run's end state and its reason."""
    attempt["ended"] = now()
    plain = status == "succeeded" or not error or error == status  # "interrupted", not "interrupted: interrupted"
    attempt["ended_because"] = status if plain else f"{status}: {error[:300]}"
