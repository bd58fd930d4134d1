"""Reading raytf's series the way Prometheus does: from each Ray node's metrics endpoint
(http://<NodeManagerAddress>:<MetricsExportPort>/metrics), parsed with prometheus_client's own parser."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of series `name` (e.g. ray_raytf_steps_total) on every alive node: (labels, value)."""
    import ray

    found = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue  # an agent still starting, or a node going away
        for family in text_string_to_metric_families(text):
            found += [(dict(s.labels), s.value) for s in family.samples if s.name == name]
    return found
