"""One way to name a project root: ``Layout(root)``, a path or a string."""

from __future__ import annotations

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
