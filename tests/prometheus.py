"""Reading raytf's series the way Prometheus does: from each Ray node's metrics endpoint
(http://<NodeManagerAddress>:<MetricsExportPort>/metrics), parsed with prometheus_client's own parser."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "ray_raytf_"


def scrape(name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of series `name` (e.g. ray_raytf_steps_total) on every alive node: (labels, value)."""
    return scrape_all().get(name, [])


def scrape_all() -> dict[str, list[tuple[dict[str, str], float]]]:
    """raytf's samples on every alive node, by series name. Only raytf's lines are parsed (an endpoint also
    serves Ray's own hundreds of series)."""
    import ray

    found: dict[str, list] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue  # an agent still starting, or a node going away
        ours = "\n".join(line for line in text.splitlines() if PREFIX in line) + "\n"
        for family in text_string_to_metric_families(ours):
            for s in family.samples:
                found.setdefault(s.name, []).append((dict(s.labels), s.value))
    return found
