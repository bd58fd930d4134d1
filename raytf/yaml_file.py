"""Reading a YAML file a user wrote (a job or sweep file), strictly: UTF-8 only, no key given twice, no
aliases that expand into a huge document. Each refusal is a SpecError naming the line. No TensorFlow."""
from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml

from raytf.errors import SpecError

MAX_VALUES = 100_000  # values in the document with every alias expanded; a job file has a few hundred


def read(path: Path) -> Any:
    """The document in `path`; SpecError for an unreadable, non-UTF-8 or invalid file."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device would block the read forever
            raise SpecError(f"{path}: not a regular file; pass the path of a job YAML file, e.g. jobs/digits.yaml")
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such job file; pass the path of a job YAML, e.g. jobs/digits.yaml") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the job file ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise SpecError(f"{path}: line {line} is not UTF-8 (byte 0x{data[exc.start]:02x}); save the file as "
                        f"UTF-8") from None
    try:
        return parse(text)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None


def parse(text: str) -> Any:
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values = _expanded_size(node, {})
        if values > MAX_VALUES:
            raise SpecError(f"its anchors and aliases expand to more than {MAX_VALUES:,} values; write the "
                            f"values out, or use fewer aliases")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many values the document holds with every alias expanded (an alias is the same node again)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a node that contains itself counts once more, not forever
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, memo) for v in node.value)
    else:
        size = 1
    memo[id(node)] = min(size, MAX_VALUES + 1)
    return memo[id(node)]


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may override keys: YAML's own rule
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise SpecError(f"line {line}: key {str(key)[:100]!r} is given twice (first on line "
                                        f"{seen[key]}); keep one")
                    seen[key] = line
                except TypeError:  # an unhashable key: PyYAML says so itself
                    pass
        return super().construct_mapping(node, deep)
