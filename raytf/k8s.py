"""`raytf k8s job.yaml`: a KubeRay RayJob manifest for the job (pure: no Ray, no Kubernetes client).

KubeRay builds a Ray cluster for the RayJob, runs the entrypoint on its head and, with backoffLimit, builds a
brand-new cluster for each retry: nothing on the cluster's disks survives. So the job's output.dir must be a
URI, and the entrypoint is `raytf run ... --resume auto`: a retry continues from the run's newest checkpoint in
storage, and a run that already succeeded trains nothing.

Sizing: one Ray worker pod per TensorFlow task (its bundle's CPUs, GPUs and custom resources), pods of the same
shape in one worker group; the head runs only the driver (num-cpus 0).
"""
from __future__ import annotations

import json
import math
import re
from importlib import metadata
from typing import Any, Sequence

import yaml

from raytf.errors import SpecError
from raytf.job import Job
from raytf.storage import is_uri

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
DEFAULT_IMAGE = "rayproject/ray:{ray}-py311"  # the job's own image must add raytf, TensorFlow and the job folder


class PlainDumper(yaml.SafeDumper):
    """YAML without anchors and aliases: a manifest a person reads, each container spelled out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def ray_version() -> str:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:  # pragma: no cover - raytf depends on ray
        return "2.60.0"


MAX_NAME = 47  # KubeRay's longest RayJob name (it adds suffixes for the cluster and the pods)
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|"
                      r"(\.[0-9]+))))?$")  # a Kubernetes resource quantity


def k8s_name(name: str) -> str:
    """A DNS-1035 name from the job's name: lower case, '-' for anything else, starting with a letter, at
    most MAX_NAME characters."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"r-{cleaned}"
    return cleaned[:MAX_NAME].strip("-") or "raytf-job"


def ray_start_resources(custom: dict[str, float]) -> str:
    """`ray start --resources` as KubeRay's rayStartParams take it: a JSON object quoted for the shell
    KubeRay pastes it into ('"{\\"spot\\":1}"')."""
    body = json.dumps({k: (int(v) if float(v).is_integer() else v) for k, v in custom.items()}, separators=(",", ":"))
    return '"' + body.replace('"', '\\"') + '"'


def worker_groups(bundles: list[dict[str, float]], memory: str) -> list[dict[str, Any]]:
    """One worker group per bundle shape, one pod (one Ray node) per bundle."""
    shapes: dict[tuple, int] = {}
    for bundle in bundles:
        key = tuple(sorted(bundle.items()))
        shapes[key] = shapes.get(key, 0) + 1
    groups = []
    for i, (shape, count) in enumerate(shapes.items()):
        bundle = dict(shape)
        cpus, gpus = bundle.pop("CPU", 0.0), bundle.pop("GPU", 0.0)
        limits: dict[str, Any] = {"cpu": str(max(1, math.ceil(cpus))), "memory": memory}
        if gpus:
            limits["nvidia.com/gpu"] = str(math.ceil(gpus))
        # `ray start --num-cpus` takes whole CPUs: a pod per bundle, so a fractional bundle rounds up
        params: dict[str, str] = {"num-cpus": str(max(1, math.ceil(cpus)))}
        if gpus:
            params["num-gpus"] = f"{math.ceil(gpus)}"
        if bundle:  # custom resources (cluster.resources_per_worker), as `ray start --resources`
            params["resources"] = ray_start_resources(bundle)
        label = f"gpu{gpus:g}-cpu{cpus:g}".replace(".", "p") if gpus else f"cpu{cpus:g}".replace(".", "p")
        groups.append({"groupName": f"workers-{label}" if len(shapes) > 1 else "workers",
                       "replicas": count, "minReplicas": count, "maxReplicas": count,
                       "rayStartParams": params, "limits": limits, "index": i})
    return groups


def rayjob(job: Job, job_file: str, *, image: str | None = None, settings: Sequence[str] = (),
           queue: str | None = None, token_secret: str | None = None, storage_secret: str | None = None,
           workdir: str = "/app", worker_memory: str = "8Gi", head_memory: str = "8Gi",
           backoff_limit: int = 2) -> dict[str, Any]:
    """The RayJob object for `job` (job_file relative to the job folder, which the image holds at `workdir`)."""
    if not is_uri(job.output_where):
        raise SpecError(f"{job.source}: output.dir {job.output_where} is on the cluster's disk, which KubeRay deletes "
                        f"with the cluster (and every retry builds a new one); set output.dir to a URI, e.g. "
                        f"--set output.dir=s3://bucket/runs/{job.spec.name}")
    for option, value in (("--worker-memory", worker_memory), ("--head-memory", head_memory)):
        if not QUANTITY.match(value):
            raise SpecError(f"{option} {value!r} is not a Kubernetes quantity; write e.g. 8Gi or 16G")
    from raytf.driver.placement import job_bundles

    image = image or DEFAULT_IMAGE.format(ray=ray_version())
    env_from = [{"secretRef": {"name": storage_secret}}] if storage_secret else []
    argv = ["raytf", "run", job_file, "--resume", "auto", *[arg for s in settings for arg in ("--set", s)]]
    entrypoint = f"cd {workdir} && " + " ".join(_quote(a) for a in argv)

    def container(name: str, limits: dict[str, Any], ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": name, "image": image, "resources": {"limits": limits, "requests": limits}}
        if ports:
            spec["ports"] = ports
        if env_from:
            spec["envFrom"] = env_from
        return spec

    head_ports = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": 10001, "name": "client"}]
    groups = []
    for group in worker_groups(job_bundles(job.spec), worker_memory):
        groups.append({
            "groupName": group["groupName"], "replicas": group["replicas"], "minReplicas": group["minReplicas"],
            "maxReplicas": group["maxReplicas"], "rayStartParams": group["rayStartParams"],
            "template": {"spec": {"containers": [container("ray-worker", group["limits"])]}},
        })
    auth: dict[str, Any] = {"mode": "token"}
    if token_secret:
        auth["secretName"] = token_secret
    name = k8s_name(job.spec.name)
    manifest: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "raytf", "raytf/job": name}},
        "spec": {
            "entrypoint": entrypoint,
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            # each retry is a new Ray cluster; `--resume auto` continues from the newest checkpoint in storage
            "backoffLimit": backoff_limit,
            "rayClusterSpec": {
                "rayVersion": ray_version(),
                "authOptions": auth,
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {"containers": [container("ray-head", {"cpu": "2", "memory": head_memory},
                                                                   head_ports)]}},
                },
                "workerGroupSpecs": groups,
            },
        },
    }
    if queue:
        manifest["metadata"]["labels"][QUEUE_LABEL] = queue
    return manifest


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
