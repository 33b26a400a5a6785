"""Every test the docs name exists: a guarantee whose proof was renamed or deleted fails here.

Names are ``tests/<path>.py::test_name``; within one table cell (or one line of prose) a bare
``::test_name`` continues the last file named before it."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"(tests/[\w/]+\.py)?((?:::\w+)+)?")


def pages(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.is_file()]


def named_tests(text: str) -> set[tuple[str, str | None]]:
    """(file, test name or None) for every test reference in ``text``."""
    found: set[tuple[str, str | None]] = set()
    for line in text.splitlines():
        for cell in line.split("|"):
            current: str | None = None
            for match in REFERENCE.finditer(cell):
                path, names = match.group(1), match.group(2)
                if path:
                    current = path
                    found.add((path, None))
                if names and current:
                    found.add((current, names.rsplit("::", 1)[-1]))
    return found


@cache
def defined_tests(path: Path) -> frozenset[str]:
    """The test names ``path`` defines; parsed once per file, as a page names many of its tests."""
    tree = ast.parse(path.read_text())
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    )


def missing(root: Path, text: str) -> list[str]:
    problems = []
    for path, name in sorted(named_tests(text), key=str):
        file = root / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
        elif name is not None and name not in defined_tests(file):
            problems.append(f"{path}::{name}: no such test")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_test_a_page_names_exists(page: Path) -> None:
    assert missing(ROOT, page.read_text()) == []


def test_references_are_read_per_cell_and_a_wrong_one_is_caught() -> None:
    row = (
        "| a promise | `tests/unit/runtime/test_layout.py::"
        "test_a_root_given_as_a_string_or_a_path_is_the_same_layout`, `::test_gone` "
        "| `::test_outside_any_file` |"
    )
    assert named_tests(row) == {
        ("tests/unit/runtime/test_layout.py", None),
        (
            "tests/unit/runtime/test_layout.py",
            "test_a_root_given_as_a_string_or_a_path_is_the_same_layout",
        ),
        ("tests/unit/runtime/test_layout.py", "test_gone"),
    }
    assert missing(ROOT, row) == ["tests/unit/runtime/test_layout.py::test_gone: no such test"]
    assert missing(ROOT, "see `tests/unit/test_nowhere.py`") == [
        "tests/unit/test_nowhere.py: no such file"
    ]
