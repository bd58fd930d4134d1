"""The job spec's reference page and JSON Schema, both made from the pydantic models, so neither can drift
from them: `raytf.spec.JobSpec` and its sections, plus the `tune:` section a sweep file adds
(`raytf.sweep.TuneSection`). Pure: imports pydantic and raytf's model modules only (no Ray, no TensorFlow).

    python -m raytf.spec_reference            # the reference page (Markdown), as the docs build writes it
    raytf schema                              # the JSON Schema of a job file
"""
from __future__ import annotations

import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from typing import Any, Iterator, Literal, NamedTuple, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from raytf.spec import JobSpec
from raytf.sweep import Dimension, TuneSection

SCHEMA_ID = "raytf-job.schema.json"

# A `tune.space` dimension as a sweep file writes it (raytf.sweep.parse_dimension reads this form).
_DIMENSION_SCHEMA = {
    "description": "One axis of the space: {grid: [a, b, ...]}, {choice: [a, b, ...]}, {uniform: [low, high]} "
                   "or {loguniform: [low, high]}.",
    "type": "object",
    "minProperties": 1,
    "maxProperties": 1,
    "additionalProperties": False,
    "properties": {
        "grid": {"type": "array", "minItems": 1},
        "choice": {"type": "array", "minItems": 1},
        "uniform": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        "loguniform": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0},
                       "minItems": 2, "maxItems": 2},
    },
}


# ---------------------------------------------------------------- walking the models


class Key(NamedTuple):
    """One key of the job file: its dotted path, the model that declares it and the field."""

    path: str
    model: type[BaseModel]
    name: str
    field: FieldInfo


class Section(NamedTuple):
    path: str  # "" for the top level; "data.decode[]" for the items of a list of sections
    model: type[BaseModel]


def _args(annotation: Any) -> tuple:
    return typing.get_args(annotation)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _nested(annotation: Any, suffix: str = "") -> Iterator[tuple[type[BaseModel], str]]:
    """The models a field's annotation holds, with the path suffix their keys take ("[]" inside a list)."""
    if _is_model(annotation):
        yield annotation, suffix
        return
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        yield from _nested(_args(annotation)[0], suffix)
    elif origin in (Union, types.UnionType):
        for arg in _args(annotation):
            yield from _nested(arg, suffix)
    elif origin in (list, tuple):
        for arg in _args(annotation):
            yield from _nested(arg, suffix + "[]")


def sections(model: type[BaseModel] = JobSpec, path: str = "") -> Iterator[Section]:
    """Every section of a job file, depth first, the top level first."""
    yield Section(path, model)
    for name, field in model.model_fields.items():
        for inner, suffix in _nested(field.annotation):
            yield from sections(inner, f"{path}.{name}{suffix}".lstrip("."))


def keys(model: type[BaseModel] = JobSpec, path: str = "") -> Iterator[Key]:
    """Every key of a job file (sections included), depth first."""
    for section in sections(model, path):
        for name, field in section.model.model_fields.items():
            yield Key(f"{section.path}.{name}".lstrip("."), section.model, name, field)


def all_sections() -> list[Section]:
    """The job spec's sections, then the sweep file's `tune:` section and its own."""
    return [*sections(JobSpec), *sections(TuneSection, "tune")]


# ---------------------------------------------------------------- describing a key


def type_name(annotation: Any) -> str:
    """A field's type as a job file writes it: `int`, `"drop" | "pad"`, `list[str]`, `section`."""
    if annotation is type(None) or annotation is None:
        return "null"
    if _is_model(annotation):
        return "section"
    if annotation is Dimension:
        return "dimension"
    if annotation is Any:
        return "any"
    if isinstance(annotation, str):  # a forward reference left as text
        return type_name(_resolve(annotation))
    origin = typing.get_origin(annotation)
    args = _args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin is dict:
        return f"map[{type_name(args[0])}, {type_name(args[1])}]"
    return getattr(annotation, "__name__", str(annotation))


def _resolve(name: str) -> Any:
    import raytf.spec

    return getattr(raytf.spec, name.split("|")[0].strip(), name)


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}


def constraints(field: FieldInfo) -> str:
    """The field's bounds and pattern: `>= 1`, `length >= 1`, `matches module:function`."""
    out = []
    for item in field.metadata:
        for attr, word in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{word} {value:,}" if isinstance(value, int) and value >= 10_000 else f"{word} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            out.append("module:function" if ":" in pattern else f"matches `{pattern}`")
    return ", ".join(out)


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "its keys' defaults"
    return json.dumps(value)


def description(model: type[BaseModel], name: str) -> str:
    """The field's `description`, else the comment written beside or above its declaration."""
    field = model.model_fields[name]
    if field.description:
        return " ".join(field.description.split())
    for cls in model.__mro__:
        comment = _field_comments(cls).get(name)
        if comment:
            return comment
    return ""


_COMMENTS: dict[type, dict[str, str]] = {}


def _field_comments(cls: type) -> dict[str, str]:
    """name -> the comment on a field's line, or the block of comment lines right above it."""
    if cls in _COMMENTS:
        return _COMMENTS[cls]
    out: dict[str, str] = {}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        _COMMENTS[cls] = out
        return out
    above: list[str] = []
    declared = re.compile(r"^    ([A-Za-z_]\w*)\s*:")
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") and line.startswith("    ") and not line.startswith("     "):
            above.append(comments.get(number, ""))
            continue
        match = declared.match(line)
        if match:
            trailing = comments.get(number) if not stripped.startswith("#") else None
            text = " ".join(p for p in (" ".join(above), trailing) if p)
            if text:
                out.setdefault(match.group(1), text)
        above = []
    _COMMENTS[cls] = out
    return out


def _docstring(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""


# ---------------------------------------------------------------- the reference page


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _code(text: str) -> str:
    """Inline code, its pipes escaped for a table cell."""
    return f"`{text}`".replace("|", "\\|")


def slug(title: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (mkdocs's default)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _title(section: Section) -> str:
    return section.path or "Top level"


def reference_markdown(level: int = 2) -> str:
    """The reference of every section and key of a job file (Markdown tables, one per section); top-level
    sections get headings of `level`, the sections inside them one level down."""
    lines = []
    for section in all_sections():
        depth = level if "." not in section.path else level + 1
        lines += ["", f"{'#' * depth} {_title(section)}", ""]
        doc = _docstring(section.model)
        if doc:
            lines += [doc, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, field in section.model.model_fields.items():
            path = f"{section.path}.{name}".lstrip(".")
            kind = _code(type_name(field.annotation))
            bounds = constraints(field)
            if bounds:
                kind += f" ({_cell(bounds)})"
            inner = [f"{path}{suffix}" for _, suffix in _nested(field.annotation)]
            if inner:
                kind += ": " + ", ".join(f"[keys](#{slug(p)})" for p in dict.fromkeys(inner))
            lines.append(f"| {_code(path)} | {kind} | {_code(default_text(field))} | "
                         f"{_cell(description(section.model, name))} |")
    return "\n".join(lines).lstrip("\n") + "\n"


# ---------------------------------------------------------------- the JSON Schema


def _with_descriptions(schema: dict, model: type[BaseModel]) -> None:
    """Comments stand in for descriptions the models do not give (editors show them on hover)."""
    for name in model.model_fields:
        prop = schema.get("properties", {}).get(name)
        text = description(model, name)
        if prop is not None and text and "description" not in prop:
            prop["description"] = text


def job_schema() -> dict[str, Any]:
    """The JSON Schema of a job file: JobSpec's, plus the optional `tune:` section of a sweep file."""
    schema = JobSpec.model_json_schema()
    tune = TuneSection.model_json_schema()
    defs = schema.setdefault("$defs", {})
    defs.update(tune.pop("$defs", {}))
    defs["Dimension"] = _DIMENSION_SCHEMA
    defs["TuneSection"] = tune
    by_name = {s.model.__name__: s.model for s in all_sections()}
    _with_descriptions(schema, JobSpec)
    for name, sub in defs.items():
        if name in by_name:
            _with_descriptions(sub, by_name[name])
    # data.decode also takes a single mapping (DataSpec's before-validator makes it a list of one)
    decode = defs["DataSpec"]["properties"]["decode"]
    items = decode.pop("items")
    decode.pop("type")
    decode["anyOf"] = [{"type": "array", "items": items}, items]
    schema["properties"]["tune"] = {
        "$ref": "#/$defs/TuneSection",
        "description": "A sweep file's section (raytf tune): the metric, the space of spec keys, the scheduler.",
    }
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_ID
    schema["title"] = "raytf job file"
    return schema


if __name__ == "__main__":
    print(reference_markdown(), end="")
