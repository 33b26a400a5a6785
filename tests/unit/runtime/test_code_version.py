"""Code versions (Prefect task versions, training backups) follow the code they name."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.runtime.code_version import code_version


@contextlib.contextmanager
def package_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, files: dict[str, str]
) -> Iterator[Path]:
    """A package ``name`` of ``files`` under ``tmp_path``, importable inside, forgotten after."""
    package = tmp_path / name
    package.mkdir()
    for file, text in files.items():
        (package / file).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield package
    finally:
        for module in [n for n in sys.modules if n.split(".")[0] == name]:
            del sys.modules[module]


def test_a_package_version_follows_every_module_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tasks.shard`` is a package: an edit to one of its modules (not its ``__init__``)
    moves the version the shard task carries."""
    files = {
        "__init__.py": "from pkg_under_test.job import work\n",
        "job.py": "def work():\n    return 1\n",
    }
    with package_on_path(tmp_path, monkeypatch, "pkg_under_test", files) as package:
        module = importlib.import_module("pkg_under_test")
        before = code_version(module)
        assert code_version("pkg_under_test") == before
        (package / "job.py").write_text("def work():\n    return 2\n")
        assert code_version(module) != before


def test_a_module_version_follows_its_own_file_only() -> None:
    from tasks.runtime import atomic, refusals

    assert code_version(atomic) != code_version(refusals)
    assert code_version(atomic) == code_version("tasks.runtime.atomic")


@pytest.fixture
def project_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the project's packages that code versions read instead of the repository's,
    so a test may edit a module."""
    from tasks.runtime import code_version as versions

    for package in versions.PACKAGES:
        shutil.copytree(
            versions.ROOT / package,
            tmp_path / package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    monkeypatch.setattr(versions, "ROOT", tmp_path)
    return tmp_path


def edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# edited\n")


def test_a_task_version_follows_function_level_imports_and_nothing_unrelated(
    project_copy: Path,
) -> None:
    """The train task's version (``tasks.train.child``, named, not imported) follows a module
    only the training run imports; an edit to the ingest stage leaves it as it was."""
    before = code_version("tasks.train.child")
    edit(project_copy / "tasks" / "ingest" / "stage.py")
    assert code_version("tasks.train.child") == before
    edit(project_copy / "tasks" / "train" / "callbacks.py")
    assert code_version("tasks.train.child") != before


def test_moving_code_between_files_changes_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bytes split differently between a package's files is other code."""
    package = tmp_path / "pkg_moved"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("x = 1\n")
    (package / "b.py").write_text("y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_version("pkg_moved")
    (package / "a.py").write_text("x = 1\ny = 2\n")
    (package / "b.py").write_text("")
    assert code_version("pkg_moved") != before


def test_a_module_run_as_main_is_versioned_with_what_it_imports() -> None:
    """`python -m tasks.train.child` names the module "__main__": its spec still names it,
    and its version covers the modules it imports, as when it is imported."""
    spec = importlib.util.find_spec("tasks.train.child")
    assert spec is not None and spec.origin is not None
    main = types.ModuleType("__main__")
    main.__spec__ = spec
    main.__file__ = spec.origin
    assert code_version(main) == code_version("tasks.train.child")


def test_the_same_code_in_two_clones_has_one_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers on other machines run other clones: a backup's code version must not name the
    clone's own folder, or no worker would ever resume another's backup."""
    from tasks.runtime import code_version as versions

    seen = []
    for clone in ("one", "two/deeper"):
        for package in versions.PACKAGES:
            shutil.copytree(
                versions.ROOT / package,
                tmp_path / clone / package,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        monkeypatch.setattr(versions, "ROOT", tmp_path / clone)
        seen.append(versions.code_version("tasks.train.child"))
    assert seen[0] == seen[1]
    edit(tmp_path / "two/deeper" / "tasks" / "contracts" / "tf_reader.py")
    assert versions.code_version("tasks.train.child") != seen[1]


def test_a_version_follows_the_cpp_source_a_module_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's op is compiled from ``raw_slice.cc`` beside its module: an edit to the C++
    moves the version of the code that reads shards, as an edit to the Python would."""
    files = {
        "__init__.py": "",
        "op.py": "def build():\n    return 1\n",
        "op.cc": "int copy() { return 1; }\n",
    }
    with package_on_path(tmp_path, monkeypatch, "native_under_test", files) as package:
        module = importlib.import_module("native_under_test.op")
        before = code_version(module)
        (package / "op.cc").write_text("int copy() { return 2; }\n")
        assert code_version(module) != before
