"""A DVC remote on a real S3 server (moto, tests/s3_server.py): raw images, shards and the
model pushed from one clone and pulled into a fresh one come back byte-identical. The endpoint
is set with `dvc remote modify --local` and the keys come from the environment: no tracked
file holds either."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from tests.conftest import write_image_folder
from tests.e2e.conftest import Project
from tests.s3_server import S3Server, add_dvc_remote, use_dvc_remote

pytestmark = pytest.mark.slow

CARRIED = ("data/raw", "data/shards", "models/model.keras")  # DVC-cached, not in git


def tree_sha256(root: Path) -> dict[str, str]:
    """sha256 of every file under each carried path, keyed by its path in the project."""
    digests = {}
    for name in CARRIED:
        path = root / name
        for file in sorted([path] if path.is_file() else path.rglob("*")):
            if file.is_file():
                digests[str(file.relative_to(root))] = hashlib.sha256(file.read_bytes()).hexdigest()
    return digests


def test_s3_remote_round_trip_is_byte_identical(
    project: Project, s3_server: S3Server, tmp_path: Path
) -> None:
    project.env.update(s3_server.env)  # keys reach DVC through the environment only
    # what `dvc init` writes: the cache and config.local stay out of git
    (project.root / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
    add_dvc_remote(project.dvc, s3_server)  # tracked: a URL, no secret
    write_image_folder(project.root / "data" / "raw", per_class=8)
    project.set_params(ingest={"source_dir": "data/raw"}, shard={"image_size": [16, 16]})
    project.dvc("add", "data/raw")
    project.dvc("repro")  # the whole pipeline: ingest, shard, validate, train, evaluate
    project.run("git", "add", "-A")
    project.run("git", "commit", "-qm", "raw images under DVC, pipeline run")
    project.dvc("push")
    pushed = tree_sha256(project.root)
    assert len([k for k in pushed if k.startswith("data/raw/")]) == 24
    assert any(k.startswith("data/shards/") and ".tfrecord-" in k for k in pushed)
    assert "models/model.keras" in pushed

    tracked = project.run("git", "ls-files").stdout.split()
    assert not [name for name in tracked if name.startswith(".dvc/cache")]
    leaked = project.run(
        "git", "grep", "-l", "-e", s3_server.secret_key, "-e", s3_server.access_key, check=False
    )
    assert leaked.stdout == "" and ".dvc/config.local" not in tracked

    clone = Project(tmp_path / "clone", {**project.env, "PYTHONPATH": str(tmp_path / "clone")})
    project.run("git", "clone", "-q", str(project.root), str(clone.root))
    use_dvc_remote(clone.dvc, s3_server)
    clone.dvc("pull")
    assert tree_sha256(clone.root) == pushed
    status = clone.dvc("status")  # the source folder's listing runs on every repro
    assert status.stdout.split() == ["source:", "always", "changed"], status.stdout
    # the remote was the only way across: the clone has its own, empty, DVC cache before pull
    assert clone.run(sys.executable, "-m", "dvc", "remote", "default").stdout.strip() == "s3"
