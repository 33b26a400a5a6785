"""The training code version over what training imports, TensorFlow and Keras included (the
rest: tests/unit/runtime/test_code_version.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.runtime import test_code_version as unit_code_version
from tests.unit.runtime.test_code_version import edit

pytestmark = pytest.mark.slow


project_copy = unit_code_version.project_copy  # the unit tests' fixture, shared


def test_the_backup_code_version_follows_every_module_training_imports(
    project_copy: Path,
) -> None:
    """``tasks.tfrecord`` (how records are read) is imported by the reader, not by
    ``tasks.train.stage``: an edit to it still changes the code a backup was made with, so the
    backup is not resumed. A hand-kept list of training modules missed it."""
    from tasks.train.stage import training_code_version

    before = training_code_version()
    edit(project_copy / "tasks" / "tfrecord.py")
    assert training_code_version() != before
