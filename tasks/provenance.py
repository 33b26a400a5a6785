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
    it, so a stage's process can version code that only its child imports (TensorFlow).
    """
    digest = hashlib.sha256()
    for module in modules:
        source = module_file(module) if isinstance(module, str) else module.__file__
        if source:
            digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


def module_file(name: str) -> str | None:
    """The source file of module ``name``, found without importing it (its package is)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"no module named {name!r}")
    return spec.origin
