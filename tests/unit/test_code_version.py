"""Code versions (Prefect task versions, training backups) follow the code they name."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tasks.code_version import code_version


def test_a_package_version_follows_every_module_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tasks.shard`` is a package: an edit to one of its modules (not its ``__init__``)
    moves the version the shard task carries."""
    package = tmp_path / "pkg_under_test"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg_under_test.job import work\n")
    job = package / "job.py"
    job.write_text("def work():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("pkg_under_test")
    try:
        before = code_version(module)
        assert code_version("pkg_under_test") == before
        job.write_text("def work():\n    return 2\n")
        assert code_version(module) != before
    finally:
        for name in [n for n in sys.modules if n.startswith("pkg_under_test")]:
            del sys.modules[name]


def test_a_module_version_follows_its_own_file_only() -> None:
    from tasks import atomic, gc_pause

    assert code_version(atomic) != code_version(gc_pause)
    assert code_version(atomic) == code_version("tasks.atomic")
