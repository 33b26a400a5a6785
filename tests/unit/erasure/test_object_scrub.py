"""What `shardflow forget` removes outside the working tree: S3 objects that hold or name a
forgotten image (a DVC remote reached with its own config, Dask staging), the Prefect
server's artifacts and flow runs that name it, and the git revisions that lost their data."""

from __future__ import annotations

import hashlib
import json
import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tasks.erasure.identity import Forgotten
from tasks.erasure.lost_revisions import broken_objects, lost_revisions, object_id
from tasks.erasure.object_scrub import dvc_s3_remotes, scrub_bucket, scrub_prefect
from tests.s3_server import S3Server

SHA = hashlib.sha256(b"the photo").hexdigest()


def test_a_dvc_remote_on_s3_loses_every_object_holding_the_image_by_identity(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remote is reached with the endpoint of its own config (.dvc/config.local), not
    the environment's; objects that are the image, list it or carry its hash go; those that
    name another image holding its name (``red/0070.png``), or that the working tree needs,
    stay."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    dvc_dir = tmp_path / ".dvc"
    dvc_dir.mkdir()
    (dvc_dir / "config").write_text(f"['remote \"s3\"']\n    url = {s3_server.url('dvc')}\n")
    local = f"['remote \"s3\"']\n    endpointurl = {s3_server.endpoint_url}\n"
    (dvc_dir / "config.local").write_text(local)
    client, bucket = s3_server.client(), s3_server.bucket
    objects = {
        "dvc/files/md5/aa/" + "1" * 30: b"the photo",  # the source file
        "dvc/files/md5/bb/" + "2" * 30: json.dumps({"sha256": SHA}).encode(),  # a record list
        "dvc/files/md5/cc/" + "3" * 30: b'[{"relpath": "red/007.png"}]',  # a listing of it
        "dvc/files/md5/dd/" + "4" * 30: b"another photo",
        "dvc/files/md5/ee/" + "5" * 30: b'[{"relpath": "red/0070.png"}, {"p": "bred/007.png"}]',
        "dvc/files/md5/ff/" + "6" * 30: b"the photo",  # the working tree's dvc.lock needs it
        f"staging/sources/{SHA}": b"re-encoded",  # out of the remote's prefix
    }
    for key, body in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)  # type: ignore[attr-defined]

    (remote,) = dvc_s3_remotes(dvc_dir)
    forgotten = Forgotten(frozenset([SHA]), frozenset(["red/007.png"]))
    removed = scrub_bucket(remote, forgotten, current={"ff" + "6" * 30})
    assert removed == [
        f"s3://{bucket}/dvc/files/md5/{p}"
        for p in ("aa/" + "1" * 30, "bb/" + "2" * 30, "cc/" + "3" * 30)
    ]
    listed = client.list_objects_v2(Bucket=bucket)["Contents"]  # type: ignore[attr-defined]
    assert sorted(o["Key"] for o in listed) == [
        "dvc/files/md5/dd/" + "4" * 30,
        "dvc/files/md5/ee/" + "5" * 30,
        "dvc/files/md5/ff/" + "6" * 30,
        f"staging/sources/{SHA}",
    ]
    assert [object_id(url) for url in removed] == [
        "aa" + "1" * 30,
        "bb" + "2" * 30,
        "cc" + "3" * 30,
    ]


class FakePrefect:
    """The sync client's read/delete calls over a list of artifacts and logs, paged as the
    server pages them."""

    def __init__(self, artifacts: list[Any], logs: list[Any]) -> None:
        self.artifacts, self.logs, self.runs_deleted = artifacts, logs, []

    def read_artifacts(self, limit: int, offset: int) -> list[Any]:
        return self.artifacts[offset : offset + limit]

    def read_logs(self, limit: int, offset: int) -> list[Any]:
        return self.logs[offset : offset + limit]

    def delete_artifact(self, artifact_id: Any) -> None:
        self.artifacts = [a for a in self.artifacts if a.id != artifact_id]

    def delete_flow_run(self, run_id: Any) -> None:
        self.runs_deleted.append(run_id)


def test_prefect_artifacts_naming_the_image_and_runs_whose_logs_do_are_deleted() -> None:
    naming = [
        SimpleNamespace(id=uuid.uuid4(), key="sheet", description="", data=f"![x](red/007.png) {i}")
        for i in range(250)  # more than a page: deletion must not skip any
    ]
    other = SimpleNamespace(id=uuid.uuid4(), key="summary", description="", data="42 records")
    run_a, run_b, run_c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    logs = [
        SimpleNamespace(flow_run_id=run_a, message=f"quarantined red/007.png ({SHA[:8]})"),
        SimpleNamespace(flow_run_id=run_b, message="ingest: 42 files found"),
        SimpleNamespace(flow_run_id=run_c, message="quarantined red/0070.png, bred/007.png"),
        SimpleNamespace(flow_run_id=None, message="red/007.png"),
    ]
    client = FakePrefect([*naming[:120], other, *naming[120:]], logs)
    done = scrub_prefect(client, Forgotten(frozenset([SHA]), frozenset(["red/007.png"])))
    assert client.artifacts == [other] and len(done.artifacts) == 250
    assert client.runs_deleted == [run_a] and done.flow_runs == [str(run_a)]


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_revisions_whose_dvc_lock_names_a_removed_object_are_listed(tmp_path: Path) -> None:
    """A commit naming a removed object, one naming a directory listing that lists one, and
    the experiment ref on the first; a commit naming neither is not listed."""
    file_md5, dir_md5, kept_md5, shard_md5 = "a" * 32, "b" * 32, "c" * 32, "d" * 32
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "ci@shardflow.invalid")
    git(tmp_path, "config", "user.name", "ci")
    commits = []
    for md5 in (file_md5, f"{dir_md5}.dir", kept_md5):
        (tmp_path / "dvc.lock").write_text(f"stages:\n  s:\n    outs:\n    - md5: {md5}\n")
        git(tmp_path, "add", "dvc.lock")
        git(tmp_path, "commit", "-qm", md5)
        commits.append(git(tmp_path, "rev-parse", "HEAD"))
    git(tmp_path, "update-ref", "refs/exps/aa/bbbb/exp-1", commits[0])
    git(tmp_path, "update-ref", "refs/exps/aa/bbbb/exp-2", commits[2])
    cache = tmp_path / ".dvc" / "cache" / "files" / "md5"
    (cache / dir_md5[:2]).mkdir(parents=True)
    listing = [{"md5": shard_md5, "relpath": "train-00000.tfrecord"}]
    (cache / dir_md5[:2] / f"{dir_md5[2:]}.dir").write_text(json.dumps(listing))

    broken = broken_objects({file_md5, shard_md5}, tmp_path / ".dvc" / "cache")
    assert broken == {file_md5, shard_md5, f"{dir_md5}.dir"}
    lost = lost_revisions(tmp_path, broken)
    assert sorted(lost.commits) == sorted(commits[:2])
    assert lost.experiments == ["refs/exps/aa/bbbb/exp-1"]
    assert lost_revisions(tmp_path, {"e" * 32}).commits == []
