"""`pip install .` brings every third-party package that tasks/ and flows/ import."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL = {"tasks", "flows"}


def imported_top_level_names() -> dict[str, str]:
    """Top-level module name -> the first file importing it (absolute imports, any depth)."""
    names: dict[str, str] = {}
    for path in sorted([*ROOT.glob("tasks/**/*.py"), *ROOT.glob("flows/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                names.setdefault(module.split(".")[0], str(path.relative_to(ROOT)))
    return {
        name: where
        for name, where in names.items()
        if name not in LOCAL and name not in sys.stdlib_module_names and name != "__future__"
    }


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        normalise(re.split(r"[\s<>=!~\[;]", dep, maxsplit=1)[0]) for dep in project["dependencies"]
    }


def test_every_imported_package_is_a_declared_dependency() -> None:
    distributions = importlib.metadata.packages_distributions()
    names = imported_top_level_names()
    assert {"tensorflow", "prefect", "google_crc32c", "ruamel"} <= set(names)  # the scan sees them
    missing = []
    for name, where in sorted(names.items()):
        candidates = {normalise(d) for d in distributions.get(name, [])}
        assert candidates, f"{where} imports {name!r}, which no installed distribution provides"
        if not candidates & declared():
            missing.append(f"{name} (imported by {where}; from {sorted(candidates)})")
    assert not missing, f"imported but not in pyproject's dependencies: {missing}"
