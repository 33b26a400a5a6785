"""One way to name a project root: ``Layout(root)``, a path or a string."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from tasks.runtime.layout import Layout


def test_a_root_given_as_a_string_or_a_path_is_the_same_layout() -> None:
    assert Layout("project") == Layout(Path("project"))
    assert Layout("project").shards_dir == Path("project") / "data" / "shards"
    assert Layout().root == Path(".")
    assert pickle.loads(pickle.dumps(Layout("project"))) == Layout("project")  # sent to children


def test_library_files_go_to_the_repository_whatever_the_environment_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's KERAS_HOME, MPLCONFIGDIR or MATPLOTLIBRC named folders and files outside the
    repository, and DVC's site cache and the CUDA kernel cache went to /var/tmp and the
    home; inside a queued DVC experiment the repository is $DVC_ROOT's."""
    from tasks.runtime.layout import keep_library_files_in

    monkeypatch.delenv("DVC_ROOT", raising=False)
    env = {"KERAS_HOME": "/home/ana/.keras", "MPLCONFIGDIR": "/home/ana/mpl"}
    env |= {"MATPLOTLIBRC": "/home/ana/matplotlibrc", "PATH": "/bin"}
    keep_library_files_in(env, tmp_path)
    assert env == {
        "KERAS_HOME": str(tmp_path.resolve() / ".shardflow" / "keras"),
        "MPLCONFIGDIR": str(tmp_path.resolve() / ".shardflow" / "matplotlib"),
        "DVC_SITE_CACHE_DIR": str(tmp_path.resolve() / ".shardflow" / "dvc"),
        "CUDA_CACHE_PATH": str(tmp_path.resolve() / ".shardflow" / "cuda"),
        "PATH": "/bin",
    }
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo"))
    keep_library_files_in(env, tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "copy")
    assert env["KERAS_HOME"] == str(tmp_path.resolve() / "repo" / ".shardflow" / "keras")


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
