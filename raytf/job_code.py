"""The job's own code, found and checked from the driver before any actor starts: each `module:function`
found (job folder, working directory, installed) without running it, then imported and called as the
actors would; a train_fn's `.fit()` under Keras 3 refused; Keras names checked.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Mapping

from raytf import backends, tf_import
from raytf.errors import SpecError
from raytf.labels import check_labels
from raytf.model_check import model_output_shape
from raytf.spec import FUNCTION_KEYS, LEGACY_INSTALL, JobSpec, function_ref


def check_job_code(spec: JobSpec, job_dir: Path, datasets: Mapping[str, Any]) -> None:
    """The checks that import the job's code (and with it, usually, TensorFlow): each named function
    exists and is callable; the loss, optimizer and metric names are Keras's."""
    tf_import.import_for_driver()
    for key in FUNCTION_KEYS:
        ref = function_ref(spec, key)
        if ref is not None:
            func = resolve_function(ref, job_dir, key)
            if key == "train_fn":
                _check_takes_ctx(ref, func)
    _check_keras_names(spec)
    if spec.model is not None:
        output = model_output_shape(spec, job_dir, resolve_function(spec.model, job_dir, "model"))
        if output is not None:
            check_labels(spec, datasets, output)


def _check_takes_ctx(ref: str, func) -> None:
    """raytf calls a train_fn with one argument, the ctx."""
    import inspect

    try:
        inspect.signature(func).bind(object())
    except TypeError:
        raise SpecError(f"train_fn: {ref} takes {inspect.signature(func)}, but raytf calls it with one argument, the "
                        f"ctx: def {ref.partition(':')[2]}(ctx)") from None
    except ValueError:  # no signature to read (a builtin): left to the call
        pass


def check_train_fn_keras(spec: JobSpec, job_dir: Path) -> None:
    """Before any actor starts: train.keras: legacy needs tf-keras installed, and a train_fn that calls
    .fit() under Keras 3 would fail inside every worker (TF 2.21's MultiWorkerMirrored and Keras 3's fit do
    not work together), so it is refused with the way out. Reads the source; imports nothing."""
    if spec.train.keras == "legacy":
        if importlib.util.find_spec("tf_keras") is None:
            raise SpecError(f"train.keras: legacy needs tf-keras (Keras 2), which is not installed; {LEGACY_INSTALL} "
                            f"(or pip install tf-keras==2.21.*)")
        return
    if spec.train.keras is not None:  # keras3, said explicitly: the user knows what the function does
        return
    module_name, _, func_name = spec.train_fn.partition(":")
    source = module_source(module_name, job_dir)
    lines = fit_calls(source, func_name) if source is not None else []
    if lines and backends.get(spec.strategy).keras3_fit_problem:
        raise SpecError(f"train_fn {spec.train_fn} calls .fit() (line {lines[0]}): "
                        f"{backends.get(spec.strategy).keras3_fit_problem}; run it under tf.keras with train.keras: "
                        f"legacy (tf-keras: {LEGACY_INSTALL}), write the loop with "
                        f"{backends.get(spec.strategy).own_step_call}, or use raytf's loop (model + data). If this "
                        f".fit() is not a Keras model's, set train.keras: keras3")


def module_source(module_name: str, job_dir: Path) -> str | None:
    """The text of a module's file, found as find_module finds it, without importing it."""
    root = code_root(module_name, job_dir)
    path = None
    if root is not None:
        candidate = root.joinpath(*module_name.split("."))
        path = candidate.with_suffix(".py") if candidate.with_suffix(".py").is_file() else candidate / "__init__.py"
    else:
        try:
            found = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            found = None
        path = Path(found.origin) if found is not None and found.origin else None
    return path.read_text() if path is not None and path.is_file() else None


def fit_calls(source: str, func_name: str) -> list[int]:
    """The lines where function `func_name` of `source`, or a function of the same module it calls (a
    `train(ctx)` wrapping Ray Train's `train_func(config)`), calls `<something>.fit(...)`."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # the import reports it
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    lines, seen, todo = set(), set(), [func_name]
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for call in ast.walk(functions[name]):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "fit":
                lines.add(call.lineno)
            elif isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                todo.append(call.func.id)
    return sorted(lines)


def code_root(module: str, job_dir: Path) -> Path | None:
    """Where `module` is found: the job folder first, then the working directory; None if installed."""
    top = module.split(".")[0]
    for root in (job_dir, Path.cwd()):
        if (root / f"{top}.py").is_file() or (root / top).is_dir():
            return root
    return None


def modules_outside(job_dir: Path, refs: list[str | None]) -> list[str]:
    """The top-level modules of `module:function` refs that are found in the working directory but not
    in the job folder: they must travel to the cluster as py_modules (the job folder travels anyway)."""
    paths = set()
    for ref in refs:
        if ref is None:
            continue
        top = ref.partition(":")[0].split(".")[0]
        root = code_root(top, job_dir)
        if root is not None and root != job_dir:
            paths.add(str(root / top) if (root / top).is_dir() else str(root / f"{top}.py"))
    return sorted(paths)


def _module_not_found(key: str, module_name: str, job_dir: Path) -> SpecError:
    return SpecError(f"{key}: module {module_name!r} not found in {job_dir} or {Path.cwd()}; "
                     f"put {module_name.replace('.', '/')}.py next to the job file")


def _on_path(module_name: str, job_dir: Path) -> None:
    """Make `module_name` import from its code root (the job folder, or the working directory). A module
    of that name imported earlier from another folder (another job in this process, e.g. a notebook's
    second job) is dropped first, or its functions would be checked in place of this job's."""
    root = code_root(module_name, job_dir)
    if root is None:
        return
    top = module_name.split(".")[0]
    loaded = sys.modules.get(top)
    where = getattr(loaded, "__file__", None)
    if loaded is not None and (where is None or Path(where).resolve().parent not in (root.resolve(), (root / top).resolve())):
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))


def find_module(ref: str, job_dir: Path, key: str = "model") -> None:
    """Whether `module:function`'s module can be found (job folder, working directory, installed),
    without running it: importing it usually imports TensorFlow, seconds that a typo should not cost."""
    module_name = ref.partition(":")[0]
    if code_root(module_name, job_dir) is not None:
        return
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package that is missing or fails to import
        found = None
    if found is None:
        raise _module_not_found(key, module_name, job_dir)


def resolve_function(ref: str, job_dir: Path, key: str = "model"):
    """Import `module:function` (job folder, then working directory, then installed) and return it."""
    module_name, _, func_name = ref.partition(":")
    _on_path(module_name, job_dir)
    bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # no __pycache__ left in the user's job folder by the driver
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise _module_not_found(key, module_name, job_dir) from None
        raise SpecError(f"{key}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # the user's module raised while importing
        raise SpecError(f"{key}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    finally:
        sys.dont_write_bytecode = bytecode
    func = getattr(module, func_name, None)
    if func is None:
        raise SpecError(f"{key}: {module_name!r} has no function {func_name!r}; "
                        f"define it or fix the name in {ref!r}")
    if not callable(func):
        raise SpecError(f"{key}: {ref!r} is a {type(func).__name__}, not a function")
    return func


def _check_keras_names(spec: JobSpec) -> None:
    """Unknown loss/optimizer/metric names fail here, not inside an actor."""
    if spec.train_fn is not None:
        return
    import keras

    try:
        keras.losses.get(spec.loss.name)
    except ValueError:
        raise SpecError(f"loss: unknown Keras loss {spec.loss.name!r}; e.g. sparse_categorical_crossentropy, mse") from None
    try:
        keras.optimizers.get({"class_name": spec.optimizer.name,
                              "config": {"learning_rate": spec.optimizer.learning_rate, **spec.optimizer.options}})
    except (ValueError, TypeError) as exc:
        raise SpecError(f"optimizer: cannot build {spec.optimizer.name!r} with "
                        f"{dict(spec.optimizer.options)}: {exc}; e.g. optimizer: {{name: adam, learning_rate: 0.001}}") from None
    for name in spec.metrics:
        try:
            keras.metrics.get(name)
        except ValueError:
            raise SpecError(f"metrics: unknown Keras metric {name!r}; e.g. accuracy, mae") from None
