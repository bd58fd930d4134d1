"""The job file's JSON Schema (`raytf schema`) and the job-spec reference page, both made from the pydantic
models (raytf/spec_reference.py). Pure and fast: no Ray, no TensorFlow."""
import json
import re
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel  # noqa: E402

from raytf.spec import JobSpec  # noqa: E402
from raytf.spec_reference import job_schema, reference_markdown  # noqa: E402
from raytf.sweep import TuneSection  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
JOB_FILES = sorted((REPO / "jobs").glob("*.yaml"))


def console_script() -> str:
    """The installed `raytf` next to this interpreter (pip install -e .), else the one on PATH."""
    beside = Path(sys.executable).parent / "raytf"
    found = str(beside) if beside.exists() else shutil.which("raytf")
    assert found, "the raytf console script is not installed: pip install -e ."
    return found


@pytest.fixture(scope="module")
def validator():
    schema = job_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def errors(validator, document) -> list[str]:
    """Each error as `path: message`, the path dotted (`train.epoch` for an unknown key under train). For an
    optional section (`anyOf: [section, null]`), the section's own error, as editors show it."""
    out = []
    for err in validator.iter_errors(document):
        inner = [e for e in err.context if not (e.validator == "type" and e.validator_value == "null")]
        for e in inner or [err]:
            out.append(f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}")
    return out


def test_raytf_schema_prints_a_json_schema_through_the_console_script():
    proc = subprocess.run([console_script(), "schema"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema == job_schema()
    assert schema["additionalProperties"] is False and {"name", "data", "train", "tune"} <= set(schema["properties"])


def test_the_schema_and_the_reference_import_neither_tensorflow_nor_ray():
    code = textwrap.dedent("""
        import sys
        import raytf.cli
        from raytf.spec_reference import job_schema, reference_markdown
        job_schema(), reference_markdown()
        print(sorted(m for m in ("tensorflow", "keras", "ray") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


@pytest.mark.parametrize("path", JOB_FILES, ids=[p.name for p in JOB_FILES])
def test_every_job_file_in_jobs_validates(validator, path):
    assert errors(validator, yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("section, typo, where", [
    (None, {"trian": {"epochs": 3}}, "'trian' was unexpected"),
    ("train", {"epoch": 3}, "train: Additional properties are not allowed ('epoch' was unexpected)"),
    ("cluster", {"wokers": 2}, "cluster: Additional properties are not allowed ('wokers' was unexpected)"),
    ("data", {"lable": "label"}, "data: Additional properties are not allowed ('lable' was unexpected)"),
    ("tune", {"metirc": "val_loss"}, "tune: Additional properties are not allowed ('metirc' was unexpected)"),
    ("cluster", {"variable_partitioner": {"shard": 2}},
     "cluster.variable_partitioner: Additional properties are not allowed ('shard' was unexpected)"),
])
def test_a_typo_in_a_key_is_flagged_naming_the_key(validator, section, typo, where):
    document = yaml.safe_load((REPO / "jobs" / "digits-sweep.yaml").read_text())
    if section is None:
        document.update(typo)
    else:
        document[section] = {**document[section], **typo}
    found = errors(validator, document)
    assert len(found) == 1 and where in found[0], found


@pytest.mark.parametrize("section, bad, where", [
    ("train", {"epochs": "three"}, "train.epochs"),
    ("cluster", {"workers": True}, "cluster.workers"),  # yes/no is not a number, in the schema as in the spec
    ("train", {"precision": "float16"}, "train.precision"),
    ("tune", {"space": {"train.epochs": {"grid": []}}}, "tune.space.train.epochs.grid"),
])
def test_a_wrong_value_is_flagged_at_its_key(validator, section, bad, where):
    document = yaml.safe_load((REPO / "jobs" / "digits-sweep.yaml").read_text())
    document[section] = {**document[section], **bad}
    found = errors(validator, document)
    assert found and all(e.startswith(where) for e in found), found


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _every_key(model: type[BaseModel], prefix: str = ""):
    """(dotted key, model, field name) of every field of every model reachable from `model`."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        yield path, model, name
        inner = _models(field.annotation)
        in_list = typing.get_origin(field.annotation) is list or any(
            typing.get_origin(a) is list for a in typing.get_args(field.annotation))
        for sub in inner:
            yield from _every_key(sub, f"{path}[]." if in_list else f"{path}.")


def test_the_reference_names_every_key_of_every_model_with_its_description():
    page = reference_markdown()
    keys = [*_every_key(JobSpec), *_every_key(TuneSection, "tune.")]
    assert len(keys) > 100
    for path, model, name in keys:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} ({model.__name__}.{name}) is not in the reference"
        # the job spec's own fields carry a Field(description=...); the tune section's, comments
        if model.__module__ in ("raytf.spec", "raytf.spec_optimizer"):
            description = model.model_fields[name].description
            assert description, f"{model.__name__}.{name} has no description"
            assert " ".join(description.split())[:40] in row.replace("\\|", "|").replace("&lt;", "<")


def test_the_docs_annotated_job_spec_is_a_valid_job_file(validator):
    page = (REPO / "docs" / "reference" / "job-spec.md").read_text()
    example = next(block for block in re.findall(r"```yaml\n(.*?)```", page, re.S) if "name: digits" in block)
    assert errors(validator, yaml.safe_load(example)) == []


def test_readme_is_short_and_its_links_into_the_docs_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (REPO / link).exists()]
    assert missing == [], missing
