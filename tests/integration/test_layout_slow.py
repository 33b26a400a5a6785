"""A dvc typed by hand, run as a process, keeps its site cache in the repository (the fast
tests: tests/unit/runtime/test_layout.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_a_dvc_typed_by_hand_keeps_its_site_cache_in_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the `dvc` our entry points start had $DVC_SITE_CACHE_DIR: one a user typed in the
    clone kept its index in /var/tmp/dvc. The clone's .dvc/config.local names the site cache
    (an absolute path: DVC reads a relative one from the working directory), keeps the
    user's other local settings, and follows the clone when it moves."""
    import shutil
    import subprocess
    import sys

    from dvc.config import Config

    from tasks.runtime.layout import keep_dvc_site_cache_in_repository

    monkeypatch.delenv("DVC_ROOT", raising=False)
    clone = tmp_path / "clone"
    clone.mkdir()
    keep_dvc_site_cache_in_repository(clone)  # not a DVC repository: nothing written
    assert list(clone.iterdir()) == []
    subprocess.run(["git", "init", "-q"], cwd=clone, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=clone, check=True)
    (clone / ".dvc" / "config.local").write_text("[core]\n    autostage = true\n")

    keep_dvc_site_cache_in_repository(clone)
    by_hand = {k: v for k, v in os.environ.items() if k != "DVC_SITE_CACHE_DIR"}
    (clone / "sub").mkdir()  # typed in a sub-folder: still the clone's
    subprocess.run(
        [sys.executable, "-m", "dvc", "status", "-q"], cwd=clone / "sub", env=by_hand, check=True
    )
    kept = clone / ".shardflow" / "dvc" / "repo"
    assert kept.is_dir() and any(kept.iterdir())
    local = Config(dvc_dir=str(clone / ".dvc"), validate=False).load_one("local")
    assert local["core"]["autostage"] == "true"
    assert local["core"]["site_cache_dir"] == str(clone.resolve() / ".shardflow" / "dvc")

    moved = tmp_path / "moved"
    shutil.move(clone, moved)
    keep_dvc_site_cache_in_repository(moved)
    local = Config(dvc_dir=str(moved / ".dvc"), validate=False).load_one("local")
    assert local["core"]["site_cache_dir"] == str(moved.resolve() / ".shardflow" / "dvc")
