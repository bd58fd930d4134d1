"""On an EC2 Spot node: turn AWS's interruption notice into Ray's drain, which raytf's driver watches for.

AWS announces a Spot reclaim two minutes ahead in the instance metadata (IMDSv2 `spot/instance-action`:
{"action": "terminate", "time": "2026-12-03T22:10:00Z"}); Ray's open-source cluster launcher does not read
it. `raytf spot-watch`, started on each spot node by cluster.yaml, polls it and runs `ray drain-node
--reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` for its own node, once. From there
raytf's jobs checkpoint at one common step and restart without the node (raytf.driver.controller).
"""
from __future__ import annotations

import datetime
import json
import subprocess
import time
import urllib.error
import urllib.request
from typing import Callable

IMDS = "http://169.254.169.254"
TOKEN_TTL_S = 300


def seconds_left(notice: str, now: float) -> int | None:
    """Seconds from `now` to the reclaim an instance-action body announces (at least 1); None when the body
    announces none (empty, or not JSON with a time)."""
    try:
        body = json.loads(notice)
        when = datetime.datetime.strptime(body["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except (ValueError, KeyError, TypeError):
        return None
    return max(1, int(when.timestamp() - now))


def instance_action(imds: str = IMDS, timeout_s: float = 2.0) -> str | None:
    """The instance-action body, or None while no interruption is scheduled (404)."""
    token_request = urllib.request.Request(f"{imds}/latest/api/token", method="PUT",
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
    with urllib.request.urlopen(token_request, timeout=timeout_s) as reply:
        token = reply.read().decode()
    request = urllib.request.Request(f"{imds}/latest/meta-data/spot/instance-action",
                                     headers={"X-aws-ec2-metadata-token": token})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def drain_this_node(deadline_s: int) -> None:
    subprocess.run(["ray", "drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message", "EC2 Spot interruption notice",
                    "--deadline-remaining-seconds", str(deadline_s)], check=True, timeout=60)


def watch(imds: str = IMDS, interval_s: float = 5.0, drain: Callable[[int], None] = drain_this_node,
          clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
          log: Callable[[str], None] = print, until: Callable[[], bool] = lambda: False) -> int | None:
    """Poll every `interval_s` until a notice comes, drain this node with its deadline, and return that
    deadline (seconds). The metadata service or the drain failing is logged and tried again at the next
    poll (the notice stays until the instance goes). `until()` true: stop."""
    while not until():
        try:
            notice = instance_action(imds)
        except OSError as exc:
            log(f"raytf spot-watch: instance metadata not answering ({exc}); trying again")
            notice = None
        left = seconds_left(notice, clock()) if notice else None
        if left is not None:
            log(f"raytf spot-watch: Spot interruption in {left}s; draining this Ray node")
            try:
                drain(left)
                return left
            except (subprocess.SubprocessError, OSError) as exc:
                log(f"raytf spot-watch: the drain failed ({exc}); trying again")
        sleep(interval_s)
    return None
