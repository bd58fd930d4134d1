"""`raytf k8s`: the KubeRay RayJob manifest. Pure: no Ray cluster, no Kubernetes; the CLI paths run the real
console script.

Every manifest these tests make is checked as Kubernetes and KubeRay 1.7 would check it: against the RayJob
CRD's own schema (tests/data/, vendored from KubeRay v1.7.0) with the API server's rules a plain JSON Schema
lacks (unknown fields, int32, the CRD's CEL rules), then against the rules KubeRay's and Kueue's code applies
(`kuberay_refusals`, from ray-operator/controllers/ray/utils/validation.go and Kueue's RayJob webhook).
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from raytf import k8s
from raytf.errors import SpecError
from raytf.job import read_job
from tests.conftest import base_spec, write_job

BIN = Path(sys.executable).parent
SCHEMA = Path(__file__).parent / "data" / "kuberay-1.7.0-rayjob-v1.schema.json"
IMAGE = "registry.example/digits:1"
pytestmark = pytest.mark.timeout(60)


def raytf_k8s(*args, cwd, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "raytf"), "k8s", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def manifest_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    check(manifest)
    return manifest


def refused(proc: subprocess.CompletedProcess) -> str:
    """The one line of a refusal: exit 2, nothing on stdout, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and not proc.stdout and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[0].startswith("raytf: error: ") and "Traceback" not in proc.stderr
    return lines[0]


# ---------------------------------------------------------------- Kubernetes' and KubeRay's checks

# The CRD's CEL rules (x-kubernetes-validations) as JSON Schema; None: a rule only an update can break.
CEL_AS_SCHEMA = {
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))": {"not": {"required": ["jobStatus",
                                                                                     "jobDeploymentStatus"]}},
    "has(self.jobStatus) || has(self.jobDeploymentStatus)": {"anyOf": [{"required": ["jobStatus"]},
                                                                       {"required": ["jobDeploymentStatus"]}]},
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))": {
        "not": {"allOf": [{"anyOf": [{"required": ["onSuccess"]}, {"required": ["onFailure"]}]},
                          {"required": ["deletionRules"]}]}},
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))": {
        "anyOf": [{"required": ["onSuccess", "onFailure"]}, {"required": ["deletionRules"]}]},
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']": {
        "enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]},
    "self == oldSelf": None,
}


def as_api_server(node):
    """The CRD schema with what the API server does beyond JSON Schema: fields the schema lacks are pruned
    (here: refused, as a field KubeRay never sees is a bug in the manifest), and the CEL rules hold."""
    if isinstance(node, list):
        return [as_api_server(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: as_api_server(value) for key, value in node.items() if key != "x-kubernetes-validations"}
    if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    rules = [CEL_AS_SCHEMA[rule["rule"]] for rule in node.get("x-kubernetes-validations", [])]  # KeyError: a new rule
    if any(rules):
        out["allOf"] = [*out.get("allOf", []), *[rule for rule in rules if rule]]
    return out


FORMATS = jsonschema.FormatChecker()
FORMATS.checks("int32")(lambda v: not isinstance(v, int) or -2**31 <= v < 2**31)
FORMATS.checks("int64")(lambda v: not isinstance(v, int) or -2**63 <= v < 2**63)


@functools.cache
def crd_validator() -> jsonschema.Draft7Validator:
    # x-kubernetes-int-or-string's anyOf [integer, string] and its pattern are plain JSON Schema; the other
    # x-kubernetes-* keys (list types, map types) are unknown keywords here and ignored
    return jsonschema.Draft7Validator(as_api_server(json.loads(SCHEMA.read_text())), format_checker=FORMATS)


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def kuberay_refusals(manifest: dict) -> list[str]:
    """What KubeRay 1.7.0's controller (ValidateRayJobMetadata, ValidateRayJobSpec, validateDeletionRules,
    ValidateRayClusterSpec) and Kueue's RayJob webhook would refuse in a manifest, beyond its schema."""
    out = []
    meta, spec = manifest["metadata"], manifest["spec"]
    if len(meta["name"]) > 47 or not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", meta["name"]):
        out.append(f"name {meta['name']!r}: at most 47 characters, DNS-1035")
    out += [f"label {k}={v!r}" for k, v in meta.get("labels", {}).items() if len(v) > 63 or not LABEL_VALUE.match(v)]
    queue = meta.get("labels", {}).get(k8s.QUEUE_LABEL)
    if queue is not None and (not DNS_1123.match(queue) or not spec.get("shutdownAfterJobFinishes")):
        out.append("Kueue: a LocalQueue name, and shutdownAfterJobFinishes")
    if spec.get("ttlSecondsAfterFinished", 0) > 0 and not spec.get("shutdownAfterJobFinishes"):
        out.append("ttlSecondsAfterFinished without shutdownAfterJobFinishes")
    rules = spec.get("deletionStrategy", {}).get("deletionRules", [])
    if rules and spec.get("shutdownAfterJobFinishes"):
        out.append("deletionRules with shutdownAfterJobFinishes")
    ttls: dict[tuple, dict[str, int]] = {}
    for rule in rules:
        condition = rule["condition"]
        key = (condition.get("jobStatus"), condition.get("jobDeploymentStatus"))
        if rule["policy"] in ttls.setdefault(key, {}):
            out.append(f"duplicate rule {rule}")
        ttls[key][rule["policy"]] = condition.get("ttlSeconds", 0)
    for key, by_policy in ttls.items():  # Workers <= Cluster <= Self
        ordered = [by_policy[p] for p in ("DeleteWorkers", "DeleteCluster", "DeleteSelf") if p in by_policy]
        if ordered != sorted(ordered):
            out.append(f"TTLs of {key} out of order: {by_policy}")
    cluster = spec["rayClusterSpec"]
    if cluster.get("authOptions", {}).get("mode") == "token" and tuple(
            int(x) for x in cluster["rayVersion"].split(".")[:2]) < (2, 52):
        out.append("token auth needs Ray 2.52+")
    for group in cluster["workerGroupSpecs"]:
        if not group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]:
            out.append(f"group {group['groupName']}: replicas outside min..max")
        if group.get("resources") and group["rayStartParams"]:
            out.append(f"group {group['groupName']}: resources in both rayStartParams and resources")
    for template in [cluster["headGroupSpec"]["template"], *[g["template"] for g in cluster["workerGroupSpecs"]]]:
        pod = template["spec"]
        if "priorityClassName" in pod and not DNS_1123.match(pod["priorityClassName"]):
            out.append(f"priorityClassName {pod['priorityClassName']!r}")
        for c in pod["containers"]:
            if re.search(r"\s", c["image"]):
                out.append(f"image {c['image']!r}")
            out += [f"secret {s['secretRef']['name']!r}" for s in c.get("envFrom", [])
                    if not DNS_1123.match(s["secretRef"]["name"])]
    return out


def check(manifest: dict) -> None:
    """A manifest the API server, KubeRay 1.7 and Kueue take as it is."""
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator().iter_errors(manifest)]
    assert not errors, errors
    assert not kuberay_refusals(manifest), kuberay_refusals(manifest)


def test_the_checks_see_what_kubernetes_and_kuberay_would_refuse(job_dir):
    """The checks are not vacuous: each kind of fault in a good manifest is caught."""
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    good = k8s.rayjob(read_job(job_dir / "job.yaml"), "job.yaml", image=IMAGE, token_secret="ray-token")
    check(good)

    def broken(change) -> dict:
        manifest = copy.deepcopy(good)
        change(manifest)
        return manifest

    faults = {
        "a field KubeRay 1.7 lacks": lambda m: m["spec"].update(preRunningDeadline=60),
        "a misspelt pod field": lambda m: m["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(
            priorityClass="high"),
        "an int32 overflow": lambda m: m["spec"].update(preRunningDeadlineSeconds=2**31),
        "a deadline of 0": lambda m: m["spec"].update(preRunningDeadlineSeconds=0),
        "a bad quantity": lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
            "containers"][0]["resources"]["limits"].update(memory="8GB"),
        "a deletion condition on two statuses (CEL)": lambda m: m["spec"]["deletionStrategy"]["deletionRules"][0][
            "condition"].update(jobDeploymentStatus="Failed"),
        "an unknown policy": lambda m: m["spec"]["deletionStrategy"]["deletionRules"][0].update(policy="Delete"),
    }
    for what, change in faults.items():
        assert list(crd_validator().iter_errors(broken(change))), what
    kuberay_faults = {
        "rules with shutdownAfterJobFinishes": lambda m: m["spec"].update(shutdownAfterJobFinishes=True),
        "workers kept longer than the cluster": lambda m: m["spec"]["deletionStrategy"]["deletionRules"][1][
            "condition"].update(ttlSeconds=7200),
        "a name of 48 characters": lambda m: m["metadata"].update(name="a" * 48),
        "a queue without shutdownAfterJobFinishes": lambda m: m["metadata"]["labels"].update(
            {k8s.QUEUE_LABEL: "team-a"}),
    }
    for what, change in kuberay_faults.items():
        assert kuberay_refusals(broken(change)), what


# ---------------------------------------------------------------- the manifest


def test_raytf_k8s_writes_a_rayjob_kuberay_accepts_sized_from_the_spec(job_dir):
    spec = base_spec(name="Digits_GPU.v2", output={"dir": "s3://team/runs/digits"}, train={"global_batch_size": 96},
                     cluster={"workers": 3, "cpus_per_worker": 4, "gpus_per_worker": 1,
                              "resources_per_worker": {"spot": 1}})
    write_job(job_dir, spec)
    manifest = manifest_of(raytf_k8s("job.yaml", "--image", IMAGE, "--storage-secret", "s3-credentials",
                                     "--set", "train.epochs=9", cwd=job_dir))

    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    assert manifest["metadata"]["name"] == "digits-gpu-v2"
    job = manifest["spec"]
    assert job["entrypoint"] == "raytf run /app/job.yaml --resume auto --set train.epochs=9"
    assert job["backoffLimit"] == 2 and job["submissionMode"] == "K8sJobMode"
    cluster = job["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"} and cluster["rayVersion"] == k8s.ray_version()
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head runs the driver, no training task
    assert head["template"]["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    [group] = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 3
    # quoted for the shell KubeRay pastes rayStartParams into, as KubeRay quotes the ones it writes (pod.go)
    assert group["rayStartParams"] == {"num-cpus": "4", "num-gpus": "1", "resources": "'{\"spot\":1}'"}
    [worker] = group["template"]["spec"]["containers"]
    assert worker["image"] == IMAGE and worker["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    assert worker["resources"]["limits"] == {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"}

    ps = write_job(job_dir, base_spec(strategy="parameter_server", output={"dir": "gs://team/ps"},
                                      cluster={"workers": 2, "ps": 2, "cpus_per_ps": 2, "cpus_per_worker": 1}),
                   "ps.yaml")
    groups = manifest_of(raytf_k8s(ps.name, "--image", IMAGE, cwd=job_dir))["spec"]["rayClusterSpec"][
        "workerGroupSpecs"]
    # the chief and 2 workers, 2 parameter servers
    assert sorted((g["rayStartParams"]["num-cpus"], g["replicas"]) for g in groups) == [("1", 3), ("2", 2)]
    half = manifest_of(raytf_k8s(ps.name, "--image", IMAGE, "--set", "cluster.cpus_per_worker=0.5",
                                 "--set", "name=2024_run", cwd=job_dir))
    assert half["metadata"]["name"] == "r-2024-run"  # a DNS-1035 name starts with a letter
    assert {g["rayStartParams"]["num-cpus"] for g in half["spec"]["rayClusterSpec"]["workerGroupSpecs"]} == {"1", "2"}

    local = refused(raytf_k8s("job.yaml", "--image", IMAGE, "--set", "output.dir=runs/x", cwd=job_dir))
    assert "KubeRay deletes with the cluster" in local and "--set output.dir=s3://bucket/runs/Digits_GPU.v2" in local
    ckpt = refused(raytf_k8s("job.yaml", "--image", IMAGE, "--set", "checkpoint.dir=ckpt", cwd=job_dir))
    assert "checkpoint.dir ckpt is on the cluster's disk" in ckpt


def test_names_cut_to_fit_stay_apart_and_valid():
    """Two job names alike in their first 47 characters were one RayJob (the second `kubectl apply` changed the
    first): a cut name now ends in a hash of the whole name."""
    stem = "experiment-resnet50-imagenet-lr-sweep-2024-batch"  # 48 characters
    a, b = k8s.k8s_name(stem + "-a"), k8s.k8s_name(stem + "-b")
    assert a != b and len(a) <= k8s.MAX_NAME and len(b) <= k8s.MAX_NAME
    assert a.startswith("experiment-resnet50-imagenet-lr-sweep-") and a == k8s.k8s_name(stem + "-a")  # stable
    for name in (stem + "-a", "x" * 200, "9" * 60, "Digits_GPU.v2", "a" + "-" * 60 + "b", "2024_run", "___"):
        got = k8s.k8s_name(name)
        assert len(got) <= k8s.MAX_NAME and re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", got), (name, got)
    assert k8s.k8s_name("digits") == "digits" and k8s.k8s_name("Digits_GPU.v2") == "digits-gpu-v2"  # short: as before


# ---------------------------------------------------------------- the entrypoint, through KubeRay's two shells

FAKE_RAY = '''\
#!{python}
"""`ray job ...` as KubeRay's submitter calls it: `job submit` joins the words after `--` as Ray's CLI does
(shlex.join), and runs the result with a shell as the job supervisor does (Popen(shell=True))."""
import os, shlex, subprocess, sys
args = sys.argv[1:]
if args[:2] == ["job", "status"]:
    sys.exit(1)  # not submitted yet
if args[:2] == ["job", "submit"]:
    entry = shlex.join(args[args.index("--") + 1:])
    sys.exit(subprocess.run(entry, shell=True, env={{**os.environ, "IN_RAY_JOB": "1"}}).returncode)
'''
FAKE_RAYTF = '''\
#!{python}
import json, os, sys
with open({record!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "in_ray_job": os.environ.get("IN_RAY_JOB")}}) + "\\n")
'''


def submitter_script(entrypoint: str) -> str:
    """The script KubeRay 1.7's K8sJobMode submitter runs with `bash -ce` (common/job.go BuildJobSubmitCommand,
    joined with spaces by rayjob_controller.go), less its wait for the dashboard."""
    address, job_id = "http://digits-head-svc:8265", "digits-abc12"
    return " ".join(["if", "!", "ray", "job", "status", "--address", address, job_id, ">/dev/null", "2>&1", ";",
                     "then", "ray", "job", "submit", "--address", address, "--no-wait", "--submission-id", job_id,
                     "--", entrypoint, ";", "fi", ";", "ray", "job", "logs", "--address", address, "--follow", job_id])


@pytest.mark.parametrize("folder", ["app", "app; touch pwned-workdir;"])
def test_every_value_reaches_raytf_run_word_for_word_on_the_head(job_dir, tmp_path, folder):
    """--workdir and --set values pasted unquoted ran as shell code; and `cd DIR && raytf run` split in KubeRay's
    submitter shell: `ray job submit -- cd DIR`, then raytf in the submitter pod, never as the Ray job."""
    ray_cli = Path(importlib.util.find_spec("ray").origin).parent / "dashboard" / "modules" / "job" / "cli.py"
    assert "shlex.join(entrypoint)" in ray_cli.read_text()  # the join the fake `ray` below copies
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    workdir = str(tmp_path / folder)
    (tmp_path / folder).mkdir()  # `cd` into it works, in whichever shell
    shell = "s3://team/runs/t$(touch pwned-set)`touch pwned-tick` 'it''s' \"q\" \\ *"
    manifest = manifest_of(raytf_k8s("job.yaml", "--image", IMAGE, "--workdir", workdir,
                                     "--set", f"output.dir={shell}", "--set", "train.epochs=3", cwd=job_dir))

    fake_bin, record, submitter = tmp_path / "bin", tmp_path / "raytf-argv.jsonl", tmp_path / "submitter"
    fake_bin.mkdir()
    submitter.mkdir()
    for name, text in (("ray", FAKE_RAY.format(python=sys.executable)),
                       ("raytf", FAKE_RAYTF.format(python=sys.executable, record=str(record)))):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["/bin/bash", "-ce", "--", submitter_script(manifest["spec"]["entrypoint"])],
                          cwd=submitter, env=env, capture_output=True, text=True, timeout=30)

    assert proc.returncode == 0, proc.stderr
    [ran] = [json.loads(line) for line in record.read_text().splitlines()]
    assert ran == {"argv": ["run", f"{workdir}/job.yaml", "--resume", "auto", "--set", f"output.dir={shell}",
                            "--set", "train.epochs=3"], "in_ray_job": "1"}
    assert not list(submitter.iterdir()) and not list(tmp_path.glob("**/pwned*")) and not list(
        job_dir.glob("pwned*"))


# ---------------------------------------------------------------- refusals: one line, exit 2


@pytest.mark.parametrize("args, says", [
    (["--image", "registry.example/digits:1 --privileged"], "--image 'registry.example/digits:1 --privileged' is not"),
    (["--image", "Registry.example/Digits:1"], "the name 'Digits' is not an image name"),
    (["--image", "registry.example/digits:1@sha256:abc"], "'sha256:abc' is not a digest"),
    (["--image", "registry.example/digits:bad/tag"], "is not an image name"),
    (["--worker-memory", "-8Gi"], "--worker-memory '-8Gi' is not more than zero"),
    (["--worker-memory", "0"], "--worker-memory '0' is not more than zero"),
    (["--worker-memory", "0.0Gi"], "--worker-memory '0.0Gi' is not more than zero"),
    (["--worker-memory", "8GB"], "--worker-memory '8GB' is not a Kubernetes quantity; write e.g. 8Gi"),
    (["--token-secret", "Ray_Token"], "--token-secret 'Ray_Token' is not a Secret name"),
    (["--storage-secret", "s3 creds"], "--storage-secret 's3 creds' is not a Secret name"),
    (["--storage-secret", "-creds"], "--storage-secret '-creds' is not a Secret name"),
    (["--priority-class", "High"], "--priority-class 'High' is not a PriorityClass name"),
    (["--queue", "Team_A"], "--queue 'Team_A' is not a Kueue LocalQueue name"),
    (["--queue", "q" * 64], "at most 63 characters"),
    (["--queue", "team-a-"], "--queue 'team-a-' is not"),
    (["--workdir", "app"], "--workdir 'app' is not an absolute path inside the image; write e.g. /app"),
    (["--queue", "team-a", "--keep-after-failure", "600"], "--keep-after-failure 600 with --queue: Kueue needs"),
])
def test_a_bad_value_is_one_line_naming_it_and_the_fix(job_dir, args, says):
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    full = args if "--image" in args else ["--image", IMAGE, *args]
    assert says in refused(raytf_k8s("job.yaml", *full, cwd=job_dir))


@pytest.mark.parametrize("image", ["digits", "digits:1", "registry.example/team/digits:1.2-rc_3",
                                   "localhost:5000/digits", "registry.example:443/a/b/c@sha256:" + "a" * 64,
                                   "Registry.Example/digits:latest", "ghcr.io/my-org/my__img:v1"])
def test_image_references_docker_takes_pass(image):
    assert k8s.image_problem(image) is None


def test_without_image_it_refuses_rather_than_write_a_manifest_that_cannot_run(job_dir):
    """The old default, rayproject/ray, has no raytf: the job failed only once the whole cluster was up (and
    again on each retry), after a manifest written without a word. --image is now required."""
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    line = refused(raytf_k8s("job.yaml", cwd=job_dir))
    assert "--image is required" in line and "rayproject/ray has no raytf" in line


def test_o_into_a_missing_folder_onto_a_folder_or_the_job_file_is_one_line(job_dir):
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    (job_dir / "out").mkdir()
    missing = refused(raytf_k8s("job.yaml", "--image", IMAGE, "-o", "nowhere/rayjob.yaml", cwd=job_dir))
    assert "-o nowhere/rayjob.yaml: the folder nowhere does not exist" in missing
    assert "-o out is a folder" in refused(raytf_k8s("job.yaml", "--image", IMAGE, "-o", "out", cwd=job_dir))
    assert "is the job file itself" in refused(raytf_k8s("job.yaml", "--image", IMAGE, "-o", "job.yaml", cwd=job_dir))
    assert yaml.safe_load((job_dir / "job.yaml").read_text())["name"] == "t"  # untouched
    ok = raytf_k8s("job.yaml", "--image", IMAGE, "-o", "out/rayjob.yaml", cwd=job_dir)
    assert ok.returncode == 0 and "raytf: wrote out/rayjob.yaml" in ok.stderr
    check(yaml.safe_load((job_dir / "out" / "rayjob.yaml").read_text()))


@pytest.mark.parametrize("setting", ["output.dir=s3://AKIAEXAMPLEKEY:wJalrSECRETKEY@team/runs/t",
                                     "checkpoint.dir=s3://AKIAEXAMPLEKEY:wJalrSECRETKEY@team/ckpt"])
def test_credentials_in_a_uri_never_reach_the_manifest_nor_the_terminal(job_dir, setting):
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    proc = raytf_k8s("job.yaml", "--image", IMAGE, "--set", setting, "-o", "rayjob.yaml", cwd=job_dir)
    line = refused(proc)
    assert "credentials" in line and "wJalrSECRETKEY" not in proc.stderr + proc.stdout
    assert not (job_dir / "rayjob.yaml").exists()


def test_credentials_in_any_set_value_are_refused_in_the_function_too(job_dir):
    """raytf.k8s refuses them itself, whatever the spec's own checks take: an entrypoint holds every --set."""
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    job = read_job(job_dir / "job.yaml")
    with pytest.raises(SpecError) as err:
        k8s.rayjob(job, "job.yaml", image=IMAGE, settings=["data.note=https://user:hunter2@example.com/x"])
    assert "--set data.note: the URI carries credentials" in str(err.value) and "hunter2" not in str(err.value)
    assert k8s.credentials_problem(["output.dir=s3://team/runs/a@b"], job) is None  # '@' in a path is no password


# ---------------------------------------------------------------- what KubeRay 1.7 offers a batch job


def test_kuberay_1_7_batch_fields_deletion_rules_deadline_priority(job_dir):
    write_job(job_dir, base_spec(output={"dir": "s3://team/runs/t"}))
    spec = manifest_of(raytf_k8s("job.yaml", "--image", IMAGE, "--token-secret", "ray-token", cwd=job_dir))["spec"]
    # after a success the cluster goes at once; after a failure the workers (and their GPUs) go at once and the
    # head stays an hour; no shutdownAfterJobFinishes (KubeRay refuses it with rules)
    assert spec["deletionStrategy"] == {"deletionRules": [
        {"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 0}},
        {"policy": "DeleteWorkers", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": 0}},
        {"policy": "DeleteCluster", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": 3600}}]}
    assert "shutdownAfterJobFinishes" not in spec and "ttlSecondsAfterFinished" not in spec
    assert spec["preRunningDeadlineSeconds"] == 1800
    assert spec["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}  # KubeRay 1.6.0+

    tuned = manifest_of(raytf_k8s("job.yaml", "--image", IMAGE, "--keep-after-success", "300", "--keep-after-failure",
                                  "0", "--start-deadline", "0", "--priority-class", "batch-low", cwd=job_dir))["spec"]
    assert tuned["deletionStrategy"]["deletionRules"] == [
        {"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 300}},
        {"policy": "DeleteCluster", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": 0}}]
    assert "preRunningDeadlineSeconds" not in tuned
    cluster = tuned["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"], *[g["template"] for g in cluster["workerGroupSpecs"]]]
    assert [p["spec"]["priorityClassName"] for p in pods] == ["batch-low"] * len(pods)

    # Kueue requires shutdownAfterJobFinishes, which KubeRay does not take with rules: one TTL for both outcomes
    queued = manifest_of(raytf_k8s("job.yaml", "--image", IMAGE, "--queue", "team-a", "--keep-after-success", "60",
                                   cwd=job_dir))
    assert queued["metadata"]["labels"][k8s.QUEUE_LABEL] == "team-a"
    assert queued["spec"]["shutdownAfterJobFinishes"] is True and queued["spec"]["ttlSecondsAfterFinished"] == 60
    assert "deletionStrategy" not in queued["spec"]


def test_the_docs_name_the_kuberay_the_manifest_needs():
    """authOptions.secretName and preRunningDeadlineSeconds are new in KubeRay 1.6.0 (1.5.1, the minimum the docs
    named, has neither: its API server would drop them without a word)."""
    schema = json.loads(SCHEMA.read_text())
    spec = schema["properties"]["spec"]["properties"]
    assert "preRunningDeadlineSeconds" in spec and "secretName" in spec["rayClusterSpec"]["properties"][
        "authOptions"]["properties"]
    docs = (Path(__file__).parents[1] / "docs" / "guides" / "storage.md").read_text()
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"KubeRay {k8s.MIN_KUBERAY}" in docs and f"KubeRay {k8s.MIN_KUBERAY}" in readme
    assert "1.5.1" not in docs

