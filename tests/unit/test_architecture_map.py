"""docs/architecture.md is the module-by-module map: every module under ``tasks/`` and ``flows/``
appears in the section of its own wing, and the map names no module that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "architecture.md"


def sections() -> dict[str, str]:
    """Each heading's first backticked path (``tasks/runtime/``, ``tasks/images.py``,
    ``flows/``) -> the folder it maps, with the text under that heading."""
    found: dict[str, str] = {}
    for block in re.split(r"^#{2,3} ", MAP.read_text(), flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        path = re.search(r"`((?:tasks|flows)/[^`]*)`", heading)
        if path:
            named = path.group(1)
            folder = named if named.endswith("/") else named.rsplit("/", 1)[0] + "/"
            found[folder] = found.get(folder, "") + body
    return found


def modules() -> dict[str, set[str]]:
    """Folder (``tasks/runtime/``, ``flows/cli/``) -> its modules' file names, ``__init__.py``
    and ``__main__.py`` left out."""
    found: dict[str, set[str]] = {}
    for path in [*(ROOT / "tasks").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]:
        if path.name not in ("__init__.py", "__main__.py"):
            folder = path.parent.relative_to(ROOT).as_posix() + "/"
            found.setdefault(folder, set()).add(path.name)
    return found


def named(body: str) -> set[str]:
    return set(re.findall(r"`([a-z_0-9]+\.py)`", body))


def test_every_module_appears_in_its_wings_section() -> None:
    mapped = sections()
    missing = {
        f"{folder}{name}"
        for folder, names in modules().items()
        for name in names
        if name not in named(mapped.get(folder, ""))
    }
    assert not missing, f"docs/architecture.md does not map {sorted(missing)}"


def test_the_map_names_only_modules_that_exist() -> None:
    existing = modules()
    stale = {
        f"{folder}{name}"
        for folder, body in sections().items()
        for name in named(body)
        if name not in existing.get(folder, set())
    }
    assert not stale, f"docs/architecture.md maps modules that are not there: {sorted(stale)}"
