"""What a team's data part pulls besides its stages' outputs (flows/team.py): the DVC outputs
that hold the source folder, which ingest reaches only through the folder's listing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dvc.repo import Repo

from flows import team
from tasks.runtime.params import default_params


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A DVC project (no git) whose params name ``data/photos`` as the source folder."""
    Repo.init(str(tmp_path), no_scm=True).close()
    params = default_params().model_dump(mode="json")
    params["ingest"]["source_dir"] = "data/photos"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    for folder in ("data/photos/cat", "data/photos/dog", "data/other"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "a.txt").write_text(folder)
    return tmp_path


@pytest.mark.parametrize(
    ("tracked", "pulled"),
    [
        (["data/photos"], ["data/photos"]),  # the folder itself
        (["data"], ["data"]),  # a folder it lies in
        (["data/photos/cat", "data/photos/dog"], ["data/photos/cat", "data/photos/dog"]),
        (["data/other"], []),  # not the source: nothing more to pull
    ],
)
def test_the_data_part_pulls_the_outputs_holding_the_source_folder(
    project: Path, tracked: list[str], pulled: list[str]
) -> None:
    with Repo(str(project)) as repo:
        for path in tracked:
            repo.add(str(project / path))
    assert team.source_outputs(project) == pulled
