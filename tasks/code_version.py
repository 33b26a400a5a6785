"""What names a piece of code: one recipe for every version stamp Shardflow records.

TensorFlow-free and dependency-free, so flows (task versions) and tasks (training backups)
share it without tasks ever importing flows.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType


def code_version(*modules: ModuleType | str) -> str:
    """A short hash of the modules' source: it changes exactly when their code does.

    A module may be named instead (``"tasks.train"``): its file is found without importing
    it, so a stage's process can version code that only its child imports (TensorFlow). A
    package (``tasks.shard``) stands for every module file in it, not its ``__init__`` alone.
    """
    digest = hashlib.sha256()
    for module in modules:
        source = module_file(module) if isinstance(module, str) else module.__file__
        if source:
            for path in package_files(Path(source)):
                digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


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
