"""What names a piece of code: one recipe for every version stamp Shardflow records.

A version covers the code a module runs, not the module alone: its file and every project
module (``tasks.*``, ``flows.*``) it imports, transitively, function-level imports included,
found by reading their source (none is imported). A hand-kept list of modules went stale
when code moved: the training backups' list missed the record reader's own module.

TensorFlow-free and dependency-free, so flows (task versions) and tasks (training backups)
share it without tasks ever importing flows; the test that every stage's ``dvc.yaml`` deps
name the modules it runs reads imports the same way (:func:`project_modules`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the repository: tasks/ and flows/
PACKAGES = ("tasks", "flows")


def code_version(*modules: ModuleType | str) -> str:
    """A short hash of the code ``modules`` run (:func:`code_files`): it changes exactly when
    that code does.

    A module may be named instead (``"tasks.train.stage"``): its file is found without importing
    it, so a stage's process can version code that only its child imports (TensorFlow).
    """
    digest = hashlib.sha256()
    for path in code_files(*modules):
        source = path.read_bytes()
        # Named as in any clone (never by the clone's own folder): a move between files counts.
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        digest.update(f"{name}\0{len(source)}\0".encode())
        digest.update(source)
    return digest.hexdigest()[:12]


def code_files(*modules: ModuleType | str) -> list[Path]:
    """The files of ``modules`` (a package: every module file in it, not its ``__init__``
    alone) and of every project module they import, transitively, in a stable order."""
    files: set[Path] = set()
    for module in modules:
        # A module run as `python -m` is named "__main__"; its spec keeps its own name.
        spec = None if isinstance(module, str) else module.__spec__
        name = module if isinstance(module, str) else spec.name if spec else module.__name__
        source = module_file(name) if isinstance(module, str) else module.__file__
        if source:
            files.update(package_files(Path(source).resolve()))
        files.update(project_modules(ROOT, name).values())
    return sorted(with_native_sources(files))


def with_native_sources(files: set[Path] | list[Path]) -> set[Path]:
    """``files`` and each module's C++ source beside it (``raw_slice.py``: ``raw_slice.cc``),
    which the module compiles and runs: its code as much as the Python is."""
    native = {path.with_suffix(".cc") for path in files if path.suffix == ".py"}
    return set(files) | {path for path in native if path.is_file()}


def package_files(source: Path) -> list[Path]:
    """``source`` itself, or every module file of its package when it is an ``__init__``."""
    if source.name != "__init__.py":
        return [source]
    return sorted(source.parent.rglob("*.py"))


def module_file(name: str) -> str | None:
    """The source file of module ``name``, found without importing it (its package is)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"no module named {name!r}")
    return spec.origin


def project_file(root: Path, module: str) -> Path | None:
    """The file of a project module under ``root`` (``pkg/mod.py`` or ``pkg/__init__.py``),
    else None (a third-party module, or none at all)."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


@functools.cache
def _imports(path: Path, mtime_ns: int, module: str) -> frozenset[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            parts = base.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            found.update(f"{base}.{alias.name}" for alias in node.names)  # maybe a submodule
    return frozenset(found)


def imported_modules(path: Path, module: str) -> frozenset[str]:
    """Every module named by an import anywhere in ``path`` (module ``module``), functions
    included: ``from pkg import name`` names ``pkg`` and ``pkg.name``, which may be a module."""
    return _imports(path, path.stat().st_mtime_ns, module)


def project_modules(root: Path, entry: str) -> dict[str, Path]:
    """``entry`` and every project module under ``root`` it imports, transitively, with their
    files; importing a module runs its package's ``__init__`` first, so that counts too."""
    seen: dict[str, Path] = {}
    todo = [entry]
    while todo:
        module = todo.pop()
        path = project_file(root, module)
        if module in seen or path is None:
            continue
        seen[module] = path
        todo.extend(imported_modules(path, module))
        todo.append(module.rpartition(".")[0])
    return seen
