"""`raytf k8s job.yaml`: a KubeRay RayJob manifest for the job (pure: no Ray, no Kubernetes client).

KubeRay builds a Ray cluster for the RayJob, runs the entrypoint on its head and, with backoffLimit, builds a
brand-new cluster for each retry: nothing on the cluster's disks survives. So the job's output.dir must be a
URI, and the entrypoint is `raytf run ... --resume auto`: a retry continues from the run's newest checkpoint in
storage, and a run that already succeeded trains nothing.

Sizing: one Ray worker pod per TensorFlow task (its bundle's CPUs, GPUs and custom resources), pods of the same
shape in one worker group; the head runs only the driver (num-cpus 0).

The fields are KubeRay 1.7's RayJob (ray.io/v1; tests/data/ holds its CRD schema, the tests validate every
manifest against it). The oldest KubeRay that keeps all of them is 1.6.0: authOptions.secretName and
preRunningDeadlineSeconds are new in 1.6.0, and deletionStrategy is on by default from 1.6.0 (an older API
server drops unknown fields without a word).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

import yaml

from raytf.errors import SpecError, clip
from raytf.job import Job
from raytf.storage import is_uri

MIN_KUBERAY = "1.6.0"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MAX_NAME = 47  # KubeRay's longest RayJob name (MaxRayJobNameLength: it adds suffixes for the cluster and the pods)
INT32_MAX = 2**31 - 1  # the CRD's int32 fields
KEEP_AFTER_FAILURE = 3600  # the head of a failed job stays an hour: its logs and dashboard for a post-mortem
START_DEADLINE = 1800  # half an hour to schedule the pods and pull the image, then the attempt fails (and retries)

# a Kubernetes resource quantity (the CRD's own pattern)
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                      r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# an image reference, as Docker's distribution/reference grammar has it
IMAGE_DOMAIN = re.compile(r"^(localhost|[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
                          r"(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*)(:[0-9]+)?$")
IMAGE_PATH = re.compile(r"^[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*$")
IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
IMAGE_DIGEST = re.compile(r"^[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}$")
URI_CREDENTIALS = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]*@", re.IGNORECASE)  # user:secret@ before the host


class PlainDumper(yaml.SafeDumper):
    """YAML without anchors and aliases: a manifest a person reads, each container spelled out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def ray_version() -> str:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:  # pragma: no cover - raytf depends on ray
        return "2.60.0"


# ---------------------------------------------------------------- what Kubernetes and KubeRay accept (pure)


def k8s_name(name: str) -> str:
    """A DNS-1035 name from the job's name: lower case, '-' for anything else, starting with a letter, at
    most MAX_NAME characters. A name cut to fit ends in a hash of the whole name, so that two jobs whose names
    differ only past the cut get different RayJobs (and clusters)."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"r-{cleaned}".rstrip("-")
    if len(cleaned) <= MAX_NAME:
        return cleaned
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{cleaned[:MAX_NAME - len(digest) - 1].rstrip('-')}-{digest}"


def quantity_problem(option: str, value: str) -> str | None:
    """Why `value` is no memory size a pod can have, or None."""
    match = QUANTITY.match(value)
    if not match:
        return f"{option} {clip(value)!r} is not a Kubernetes quantity; write e.g. 8Gi or 16G"
    if match.group(1) == "-" or float(match.group(2)) == 0:
        return f"{option} {value!r} is not more than zero; write e.g. 8Gi or 16G"
    return None


def image_problem(image: str) -> str | None:
    """Why `image` is no image reference ([registry[:port]/]name[:tag][@digest]), or None."""
    fix = "write [registry[:port]/]name[:tag][@sha256:<digest>], e.g. registry.example/digits:1"
    if not image or len(image) > 512 or any(c.isspace() for c in image):
        return f"--image {clip(image)!r} is not an image reference (empty, too long or with a blank); {fix}"
    rest, _, digest = image.partition("@")
    if digest and not IMAGE_DIGEST.match(digest):
        return f"--image {image!r}: {digest!r} is not a digest; {fix}"
    # as Docker splits it: the first part is a registry if it has a '.' or a ':' or is localhost
    first, slash, remainder = rest.partition("/")
    registry = slash and ("." in first or ":" in first or first == "localhost")
    domain, path = (first, remainder) if registry else ("", rest)
    if domain and not IMAGE_DOMAIN.match(domain):
        return f"--image {image!r}: {domain!r} is not a registry host[:port]; {fix}"
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not IMAGE_TAG.match(tag):
            return f"--image {image!r}: {tag!r} is not a tag (letters, digits, '_', '.', '-'); {fix}"
    if not IMAGE_PATH.match(path) or len(path) + len(domain) > 255:
        return (f"--image {image!r}: the name {path!r} is not an image name (lower-case letters, digits and "
                f"'.', '_', '-' between them, parts joined by '/'); {fix}")
    return None


def object_name_problem(option: str, value: str, kind: str, example: str) -> str | None:
    """Why `value` cannot name a Kubernetes object (a DNS-1123 subdomain), or None."""
    if len(value) <= 253 and DNS_1123_SUBDOMAIN.match(value):
        return None
    return (f"{option} {clip(value)!r} is not a {kind} name: lower-case letters, digits, '-' and '.', starting "
            f"and ending with a letter or digit, at most 253 characters, e.g. {example}")


def queue_problem(queue: str) -> str | None:
    """Why `queue` cannot be the Kueue queue label: the API server takes a label value (at most 63 characters)
    and Kueue's webhook a LocalQueue name (a DNS-1123 subdomain), or None."""
    if len(queue) <= 63 and DNS_1123_SUBDOMAIN.match(queue):
        return None
    return (f"--queue {clip(queue)!r} is not a Kueue LocalQueue name: lower-case letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit, at most 63 characters (a label value), e.g. team-a")


def workdir_problem(workdir: str) -> str | None:
    if workdir.startswith("/") and "\0" not in workdir:
        return None
    return f"--workdir {clip(workdir)!r} is not an absolute path inside the image; write e.g. /app"


def credentials_problem(settings: Sequence[str], job: Job) -> str | None:
    """Credentials inside a URI (s3://KEY:SECRET@bucket/...) would be written into the manifest (--set values
    are part of the entrypoint) and so into every log and `kubectl get rayjob -o yaml`. The text names where,
    never the secret."""
    places = [f"--set {s.partition('=')[0]}" for s in settings if URI_CREDENTIALS.search(s.partition("=")[2])]
    places += [key for key, where in (("output.dir", job.output_where), ("checkpoint.dir", job.checkpoint_dir))
               if where and URI_CREDENTIALS.match(where)]
    if not places:
        return None
    return (f"{places[0]}: the URI carries credentials before '@', which the manifest would show to anyone who "
            f"can read the RayJob; give scheme://<bucket>/<path> and the credentials in a Secret: "
            f"--storage-secret NAME (e.g. keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")


def storage_problem(job: Job) -> str | None:
    """A run's files on the cluster's disk are lost: KubeRay deletes the cluster, and every retry builds a new one."""
    if not is_uri(job.output_where):
        return (f"{job.source}: output.dir {job.output_where} is on the cluster's disk, which KubeRay deletes with "
                f"the cluster (and every retry builds a new one); set output.dir to a URI, e.g. "
                f"--set output.dir=s3://bucket/runs/{job.spec.name}")
    if job.checkpoint_dir is not None and not is_uri(job.checkpoint_dir):
        return (f"{job.source}: checkpoint.dir {job.spec.checkpoint.dir} is on the cluster's disk, which a retry "
                f"never sees; remove it (checkpoints then go to {job.output_where}/checkpoints) or give a URI")
    return None


def output_file_problem(output_file: str, job_file: str) -> str | None:
    """Why the manifest cannot be written to `output_file` (checked before anything is written), or None."""
    path = Path(output_file).expanduser()
    if path.is_dir():
        return f"-o {output_file} is a folder; give a file name, e.g. -o {Path(output_file) / 'rayjob.yaml'}"
    if not path.parent.is_dir():
        return f"-o {output_file}: the folder {path.parent} does not exist; make it first or write elsewhere"
    if path.exists() and path.resolve() == Path(job_file).expanduser().resolve():
        return f"-o {output_file} is the job file itself; write the manifest elsewhere, e.g. -o rayjob.yaml"
    return None


# ---------------------------------------------------------------- the manifest


def ray_start_resources(custom: dict[str, float]) -> str:
    """`ray start --resources` as KubeRay's rayStartParams take it: a JSON object quoted for the shell KubeRay
    pastes it into, the way KubeRay quotes the ones it writes itself ('{"spot":1}')."""
    body = json.dumps({k: (int(v) if float(v).is_integer() else v) for k, v in custom.items()}, separators=(",", ":"))
    return shlex.quote(body)


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


def entrypoint(job_file: str, workdir: str, settings: Sequence[str]) -> str:
    """`raytf run <workdir>/<job_file> --resume auto [--set ...]`, each word quoted. KubeRay pastes the
    entrypoint into the submitter's `bash -c "... ray job submit -- <entrypoint> ..."`, and `ray job submit`
    joins the words it gets (shlex.join) for the head's shell: one plain command, quoted once, arrives word for
    word. No `cd dir &&`: the submitter's bash would run whatever follows `&&` itself, in the submitter pod."""
    argv = ["raytf", "run", str(PurePosixPath(workdir) / job_file), "--resume", "auto",
            *[arg for s in settings for arg in ("--set", s)]]
    return shlex.join(argv)


def deletion(queue: str | None, keep_after_success: int, keep_after_failure: int | None) -> dict[str, Any]:
    """What KubeRay deletes when the job has ended, as RayJob spec fields.

    Without a queue, deletion rules: after a success the cluster goes (keep_after_success s later); after a
    failure (the last attempt's) the workers and their GPUs go at once and the head stays keep_after_failure s
    for its logs and dashboard. With a Kueue queue: Kueue requires shutdownAfterJobFinishes, which KubeRay does
    not combine with deletion rules, so one TTL (keep_after_success) for both outcomes."""
    if queue:
        if keep_after_failure is not None:
            raise SpecError(f"--keep-after-failure {keep_after_failure} with --queue: Kueue needs the cluster deleted "
                            f"when the job ends (shutdownAfterJobFinishes), which KubeRay cannot combine with a "
                            f"separate TTL for failures; drop --keep-after-failure (--keep-after-success sets the "
                            f"one TTL) or --queue")
        return {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": keep_after_success}
    failure = KEEP_AFTER_FAILURE if keep_after_failure is None else keep_after_failure
    rules = [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": keep_after_success}}]
    if failure:  # (a head kept: workers first; KubeRay wants DeleteWorkers' TTL <= DeleteCluster's)
        rules.append({"policy": "DeleteWorkers", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": 0}})
    # jobDeploymentStatus Failed: the Ray job failed, or the cluster never got ready (preRunningDeadlineSeconds)
    rules.append({"policy": "DeleteCluster", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": failure}})
    return {"deletionStrategy": {"deletionRules": rules}}


def rayjob(job: Job, job_file: str, *, image: str | None, settings: Sequence[str] = (),
           queue: str | None = None, token_secret: str | None = None, storage_secret: str | None = None,
           priority_class: str | None = None, workdir: str = "/app", worker_memory: str = "8Gi",
           head_memory: str = "8Gi", backoff_limit: int = 2, keep_after_success: int = 0,
           keep_after_failure: int | None = None, start_deadline: int = START_DEADLINE) -> dict[str, Any]:
    """The RayJob object for `job` (job_file relative to the job folder, which the image holds at `workdir`).
    SpecError, naming the value and the fix, for anything Kubernetes, KubeRay or Kueue would refuse."""
    if not image:  # rayproject/ray has no raytf: the job would fail only once the whole cluster is up
        raise SpecError(f"--image is required: the image of every Ray pod, with Ray {ray_version()}, raytf, "
                        f"TensorFlow and the job folder at --workdir (rayproject/ray has no raytf), e.g. "
                        f"--image registry.example/digits:1")
    problems = [
        credentials_problem(settings, job), storage_problem(job), image_problem(image), workdir_problem(workdir),
        quantity_problem("--worker-memory", worker_memory), quantity_problem("--head-memory", head_memory),
        queue_problem(queue) if queue is not None else None,
        *[object_name_problem(option, value, kind, example) for option, value, kind, example in (
            ("--token-secret", token_secret, "Secret", "ray-token"),
            ("--storage-secret", storage_secret, "Secret", "s3-credentials"),
            ("--priority-class", priority_class, "PriorityClass", "batch-low")) if value is not None],
    ]
    for problem in problems:
        if problem:
            raise SpecError(problem)
    from raytf.driver.placement import job_bundles

    def pod(name: str, limits: dict[str, Any], ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        container: dict[str, Any] = {"name": name, "image": image,
                                     "resources": {"limits": limits, "requests": limits}}
        if ports:
            container["ports"] = ports
        if storage_secret:
            container["envFrom"] = [{"secretRef": {"name": storage_secret}}]
        spec: dict[str, Any] = {"containers": [container]}
        if priority_class:  # the scheduler's (and Kueue's) priority and preemption
            spec["priorityClassName"] = priority_class
        return {"spec": spec}

    head_ports = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": 10001, "name": "client"}]
    groups = [{"groupName": g["groupName"], "replicas": g["replicas"], "minReplicas": g["minReplicas"],
               "maxReplicas": g["maxReplicas"], "rayStartParams": g["rayStartParams"],
               "template": pod("ray-worker", g["limits"])}
              for g in worker_groups(job_bundles(job.spec), worker_memory)]
    auth: dict[str, Any] = {"mode": "token"}
    if token_secret:
        auth["secretName"] = token_secret
    name = k8s_name(job.spec.name)
    spec: dict[str, Any] = {
        "entrypoint": entrypoint(job_file, workdir, settings),
        "submissionMode": "K8sJobMode",
        # each retry is a new Ray cluster; `--resume auto` continues from the newest checkpoint in storage
        "backoffLimit": backoff_limit,
        **deletion(queue, keep_after_success, keep_after_failure),
    }
    if start_deadline:  # pods that never schedule (no such GPU, a wrong image) fail the attempt, not hang
        spec["preRunningDeadlineSeconds"] = start_deadline
    spec["rayClusterSpec"] = {
        "rayVersion": ray_version(),
        "authOptions": auth,
        "headGroupSpec": {
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
            "template": pod("ray-head", {"cpu": "2", "memory": head_memory}, head_ports),
        },
        "workerGroupSpecs": groups,
    }
    labels = {"app.kubernetes.io/managed-by": "raytf", "raytf/job": name}
    if queue:
        labels[QUEUE_LABEL] = queue
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name, "labels": labels}, "spec": spec}
