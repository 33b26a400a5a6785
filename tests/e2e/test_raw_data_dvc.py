"""Raw images under DVC: push from one clone, pull into another (its files links into its DVC
cache: `cache.type symlink`), `dvc repro` rebuilds the same shards (same fingerprint) and
leaves `dvc status` clean."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import write_image_folder
from tests.e2e.conftest import Project

pytestmark = pytest.mark.slow

DATA_STAGES = "validate"  # `dvc repro validate` runs ingest, shard and validate


def test_raw_data_round_trip_rebuilds_identical_shards(project: Project, tmp_path: Path) -> None:
    write_image_folder(project.root / "data" / "raw", per_class=8)
    project.set_params(ingest={"source_dir": "data/raw"}, shard={"image_size": [16, 16]})
    project.dvc("add", "data/raw")
    project.run("git", "add", "data/raw.dvc", "data/.gitignore", "params.yaml")
    project.run("git", "commit", "-qm", "raw images under DVC")
    project.dvc("repro", DATA_STAGES)
    project.run("git", "add", "dvc.lock")
    project.run("git", "commit", "-qm", "data stages")
    project.dvc("push")
    fingerprint = json.loads((project.root / "data/shards/manifest.json").read_text())[
        "fingerprint"
    ]

    clone = Project(tmp_path / "clone", {**project.env, "PYTHONPATH": str(tmp_path / "clone")})
    project.run("git", "clone", "-q", str(project.root), str(clone.root))
    assert not (clone.root / "data" / "raw").exists()
    clone.dvc("config", "--local", "cache.type", "symlink")
    clone.dvc("pull", "data/raw.dvc")  # only the raw images: the shards are rebuilt here
    assert not (clone.root / "data" / "shards").exists()
    assert all(p.is_symlink() for p in (clone.root / "data" / "raw").rglob("*.*"))
    clone.dvc("repro", DATA_STAGES)
    rebuilt = json.loads((clone.root / "data/shards/manifest.json").read_text())["fingerprint"]
    assert rebuilt == fingerprint
    status = clone.dvc("status", DATA_STAGES)
    assert "up to date" in status.stdout, status.stdout
    assert os.listdir(clone.root / "data" / "shards") == os.listdir(project.root / "data/shards")
