"""tests/unit mirrors the house (docs/architecture.md): a folder for each wing of ``tasks/``,
one for the pixel contract, the entry points and the benchmark, and only house-wide tests at
its top. It holds fast tests only: one that trains, serves or starts a server is marked
``slow`` and lives with the flow and end-to-end tests (tests/integration/, tests/flows/,
tests/e2e/)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"
# Besides the wings: the pixel contract and the served pyfunc at the top of tasks/, the
# entry points (flows/) and the benchmark (bench/).
OTHER_ROOMS = {"pixels", "flows", "bench"}
HOUSE_WIDE = {
    "test_architecture_map.py",
    "test_commands.py",
    "test_docs_tests_exist.py",
    "test_gpu_lock.py",
    "test_house.py",
    "test_packaging.py",
    "test_stage_deps.py",
    "test_unit_tests_mirror_the_wings.py",
    "test_workspace_guard.py",
}


def wings(tasks: Path) -> set[str]:
    return {p.name for p in tasks.iterdir() if (p / "__init__.py").is_file()}


def test_each_wing_has_its_folder_and_only_house_wide_tests_sit_at_the_top() -> None:
    folders = {p.name for p in UNIT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == wings(ROOT / "tasks") | OTHER_ROOMS
    assert all(any((UNIT / folder).glob("test_*.py")) for folder in folders)
    assert {p.name for p in UNIT.glob("*.py")} == HOUSE_WIDE


def test_test_files_have_unique_basenames_and_no_package_faces() -> None:
    """pytest imports a test file by its basename when no ``__init__.py`` makes a package."""
    files = list((ROOT / "tests").rglob("test_*.py"))
    twice = [name for name, count in Counter(p.name for p in files).items() if count > 1]
    assert twice == []
    assert list((ROOT / "tests").rglob("__init__.py")) == []


def test_no_unit_test_is_marked_slow() -> None:
    marked = [
        p.relative_to(ROOT).as_posix()
        for p in UNIT.rglob("test_*.py")
        if "mark.slow" in p.read_text() and p != Path(__file__).resolve()
    ]
    assert marked == []
