"""The house's shape: no import circle among raytf's modules, actor code never importing the driver's,
and strategy decisions only in the backends.

Every import counts, the ones inside functions too (they hold a circle open as well as top-level ones);
only imports under `if TYPE_CHECKING:` are left out, as they never run. Pure: reads source, imports nothing.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root/package`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, outside `if TYPE_CHECKING:` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                todo.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            todo.append(child)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports. `from pkg import name` points at pkg.name when that is a
    module, else at pkg; a parent package run implicitly by importing a submodule is not an edge."""
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted; self-imports aside."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_raytf_has_no_import_circle():
    graph = import_graph(REPO, "raytf")
    assert len(graph) > 40  # every module was read
    assert "raytf.spec" in graph["raytf.job"] and "raytf.actor.inputs" in graph["raytf.actor.steps"]
    assert circles(graph) == []


def test_the_circle_test_finds_a_circle_held_open_by_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    assert circles(import_graph(tmp_path, "pkg")) == []  # a type-only import is not a circle
    (pkg / "c.py").write_text("from . import a\n")
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


# The driver side: what runs only in the process that loads a job and drives it (raytf run, raytf.fit, a sweep and
# its trials), never in an actor. An actor gets its job already read and checked (the JobSpec and DatasetInfo in
# its WorkerPayload), so it needs none of this; an import of it would put the driver's work (job files, the
# job's code checked, Parquet footers scanned, Ray Tune, MLflow, the CLI) and its imports into every worker, and
# tie the two sides so that neither can change alone. A name covers its submodules; "raytf" is only the
# package's face (fit, tune), not every module under it.
DRIVER_SIDE = (
    "raytf",  # fit and tune
    "raytf.driver",  # the controller and everything it runs the job with
    "raytf.job", "raytf.job_code", "raytf.model_check", "raytf.spec_rules", "raytf.yaml_file",  # loading a job
    "raytf.data_scan",  # the data set read from Parquet metadata, before any actor starts
    "raytf.tuner", "raytf.sweep", "raytf.sweep_capacity", "raytf.sweep_plan", "raytf.sweep_trial",
    "raytf.sweep_results", "raytf.sweep_report", "raytf.search", "raytf.trial_checkpoint",  # sweeps
    "raytf.tracking",  # MLflow, logged by the driver
    "raytf.cli", "raytf.console_exit", "raytf.submit", "raytf.results", "raytf.k8s", "raytf.spot_watch",  # commands
    "raytf.spec_reference",
)


def imports_into(graph: dict[str, set[str]], package: str, banned: tuple[str, ...]) -> list[str]:
    """Each import, as "a -> b", of a `banned` module by a module in `package` (it or its submodules). A banned
    name covers its submodules, except the root package's own name, which stands for its __init__ alone."""
    root = package.split(".")[0]

    def under(name: str, top: str) -> bool:
        return name == top or (top != root and name.startswith(f"{top}."))

    return sorted(f"{a} -> {b}" for a, targets in graph.items() if under(a, package)
                  for b in targets if any(under(b, top) for top in banned))


def test_actor_code_never_imports_driver_code():
    graph = import_graph(REPO, "raytf")
    missing = [name for name in DRIVER_SIDE if name not in graph]
    assert missing == [], f"{missing}: no such module; a name renamed or gone must leave DRIVER_SIDE too"
    assert imports_into(graph, "raytf.actor", DRIVER_SIDE) == []


def test_the_floor_test_finds_an_actor_importing_driver_code_also_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    for folder in (pkg, pkg / "actor", pkg / "driver"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    (pkg / "job.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "driver" / "run.py").write_text("")
    (pkg / "actor" / "loop.py").write_text("from pkg import errors\nfrom pkg.actor import steps\n")
    (pkg / "actor" / "steps.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.job\n")
    banned = ("pkg", "pkg.driver", "pkg.job")
    assert imports_into(import_graph(tmp_path, "pkg"), "pkg.actor", banned) == []  # shared code and types only
    (pkg / "actor" / "steps.py").write_text("import pkg\n\ndef f():\n    from pkg.driver import run\n    from pkg import job\n")
    assert imports_into(import_graph(tmp_path, "pkg"), "pkg.actor", banned) == [
        "pkg.actor.steps -> pkg", "pkg.actor.steps -> pkg.driver.run", "pkg.actor.steps -> pkg.job"]


def test_strategy_names_are_compared_only_in_the_backends():
    """A `strategy == "..."` outside raytf/backends is a decision that belongs to a backend."""
    hits = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "raytf").rglob("*.py"))
            if "backends" not in path.parts
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"strategy\s*[!=]=", line)]
    assert hits == []


MAX_LINES = 500  # a file past this holds more than one role: split it by the process it runs in, or by role


def test_no_module_of_raytf_is_longer_than_the_limit():
    long = {str(path.relative_to(REPO)): n for path in sorted((REPO / "raytf").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: {long}"
