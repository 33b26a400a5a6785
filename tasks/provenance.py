"""What names a piece of code: one recipe for every version stamp Shardflow records.

TensorFlow-free and dependency-free, so flows (task versions) and tasks (training backups)
share it without tasks ever importing flows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType


def code_version(*modules: ModuleType) -> str:
    """A short hash of the modules' source: it changes exactly when their code does."""
    digest = hashlib.sha256()
    for module in modules:
        source = getattr(module, "__file__", None)
        if source:
            digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]
