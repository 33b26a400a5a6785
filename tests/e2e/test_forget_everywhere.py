"""`shardflow forget` on a real project: after it, no file of the clone, its DVC cache and
remote or its tracking store holds the image's bytes, its record's pixels or its name; the
other records are unchanged; the champion never saw it; `lineage` says only when it went.

Twice: a project of one machine (a DVC remote in a folder, a SQLite tracking store in the
clone), and a team's (the DVC remote on S3, `mlflow server` with its artifacts on S3, started
as `shardflow team-demo` starts them: flows/demo/team_demo.py)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flows.demo.team_demo import started_team
from flows.servers.s3_server import S3Server
from tasks.contracts.manifest import load_manifest
from tasks.runtime.layout import Layout
from tasks.schema import HASH_KEY, IMAGE_KEY
from tasks.tfrecord import open_records, read_framed
from tests.e2e.conftest import Project, api_post
from tests.s3_server import add_dvc_remote

pytestmark = pytest.mark.slow


def records(shards: Path) -> dict[str, tuple[bytes, bytes]]:
    """content hash -> (the record's bytes, its pixels), over every shard of the set."""
    manifest = load_manifest(shards)
    schema, found = manifest.record_schema, {}
    for info in manifest.splits.values():
        for shard in info.shards:
            with open_records(shards / shard.file) as handle:
                while (data := read_framed(handle)) is not None:
                    features = schema.parse(data)
                    found[features[HASH_KEY]] = (data, features[IMAGE_KEY].tobytes())
    return found


def files_holding(roots: list[Path], marks: list[bytes]) -> list[str]:
    """The files under ``roots`` (or the files named) that hold any of ``marks``."""
    return sorted(
        str(path)
        for root in roots
        for path in ([root] if root.is_file() else root.rglob("*"))
        if path.is_file() and not path.is_symlink() and any(m in path.read_bytes() for m in marks)
    )


def objects_holding(s3: S3Server, marks: list[bytes]) -> list[str]:
    """The objects of the bucket whose key or bytes hold any of ``marks``."""
    client: Any = s3.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket)
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    assert keys, f"nothing in s3://{s3.bucket}: the searched store is not the one used"
    return sorted(
        key
        for key in keys
        if any(
            m in key.encode() or m in client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
            for m in marks
        )
    )


@dataclass(frozen=True)
class Stores:
    """Where a project keeps its data and runs outside the clone: files (a DVC remote in a
    folder, a tracking server's backend store) and an S3 bucket (a DVC remote, a tracking
    server's artifacts)."""

    files: list[Path]
    s3: S3Server | None = None

    def holding(self, marks: list[bytes]) -> list[str]:
        found = files_holding(self.files, marks)
        return found + (objects_holding(self.s3, marks) if self.s3 else [])


@pytest.fixture(params=["one-machine", "team"])
def stores(
    request: pytest.FixtureRequest,
    project: Project,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Stores]:
    """The project's stores: its own (the folder remote, mlflow.db in the clone), or a
    team's S3 server (the DVC remote) and `mlflow server` (artifacts on that S3 server)."""
    if request.param == "one-machine":
        yield Stores([tmp_path / "dvc-remote"])
        return
    with started_team(tmp_path / "team", prefect_url=project.env["PREFECT_API_URL"]) as team:
        assert team.s3 is not None
        project.env.update({**team.s3_env, "MLFLOW_TRACKING_URI": team.tracking_url})
        for name, value in team.s3_env.items():
            monkeypatch.setenv(name, value)
        add_dvc_remote(project.dvc, team.s3)
        yield Stores([team.base / "tracking.db"], team.s3)


def shardflow(project: Project, *args: str, check: bool = True) -> str:
    return project.run(sys.executable, "-m", "flows.cli", *args, check=check).stdout


def lineage(*args: str) -> Any:
    """`shardflow lineage ... --json` (what the command runs) in this process, in the
    project, on its store."""
    from flows.cli.lineage import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


def build_in_process(project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage's work done by its plain function in this process (what `dvc repro`
    runs, without a process and a Prefect flow a stage), then recorded in dvc.lock by
    `dvc commit` and pushed: the state `dvc repro && dvc push` leaves."""
    from tasks.contracts.membership import archive_membership
    from tasks.evaluate.stage import run_evaluate
    from tasks.ingest.source_check import write_listing
    from tasks.ingest.stage import run_ingest
    from tasks.runtime.atomic import write_json
    from tasks.runtime.dataset_identity import dataset_identity
    from tasks.runtime.metrics_files import INGEST_FIGURES, split_figures
    from tasks.runtime.params import load_params
    from tasks.shard.stage import shard_stage
    from tasks.train.stage import run_train
    from tasks.validate.stage import validate_layout

    monkeypatch.chdir(project.root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", project.env["MLFLOW_TRACKING_URI"])
    layout = Layout(project.root)
    params = load_params(layout.params)
    write_listing(layout.root, params.ingest.source_dir)  # the source stage's listing
    report = run_ingest(params.ingest, layout.index, layout.ingest_report)
    write_json(layout.ingest_metrics, split_figures(report, INGEST_FIGURES)[0])
    manifest = shard_stage(
        params.shard, layout.index, layout.shards_dir, diff_path=layout.shard_changes
    ).manifest
    archive_membership(layout.shards_dir, layout.membership_archive, manifest.fingerprint)
    dataset = dataset_identity(params.ingest.source_dir, params.ingest.labels_csv, layout.root)
    assert validate_layout(layout, params.validate_, dataset)["passed"]
    run_train(params, layout)
    run_evaluate(params, layout)
    project.dvc("commit", "-f")
    project.dvc("push")


def prefect_records_naming(api: str, path: str) -> tuple[str, str]:
    """An artifact and a flow run's log line on the Prefect server that name the image, as
    a label-review sheet and an ingest warning would; their ids."""
    flow = api_post(api, "/flows/", {"name": "label-review"})
    run = api_post(api, "/flow_runs/", {"flow_id": flow["id"], "name": "review"})
    line = {"name": "ingest", "level": 30, "message": f"check {path}", "flow_run_id": run["id"]}
    api_post(api, "/logs/", [{**line, "timestamp": "2026-01-01T00:00:00Z"}])  # type: ignore[arg-type]
    sheet = {"key": "label-review", "type": "markdown", "data": f"![suspect]({path})"}
    return api_post(api, "/artifacts/", sheet)["id"], run["id"]


def pictures(client: Any, run_id: str) -> list[str]:
    """A run's artifacts that are pictures (a sheet of images may show the image's pixels,
    which no byte search finds in a compressed file)."""
    from tasks.erasure.retraction import PICTURES

    found: list[str] = []
    folders: list[str | None] = [None]
    while folders:
        for info in client.list_artifacts(run_id, folders.pop()):
            if info.is_dir:
                folders.append(info.path)
            elif info.path.lower().endswith(PICTURES):
                found.append(info.path)
    return found


# The build validates in this process: its report, not the cross-check's child (tests/conftest.py).
@pytest.mark.usefixtures("tf_cross_check_in_process")
def test_forget_leaves_no_copy_and_a_champion_that_never_saw_it(
    project: Project, stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.set_params(train={"epochs": 1})
    build_in_process(project, monkeypatch)
    project.run("git", "add", "dvc.lock", ".dvc/config")
    project.run("git", "commit", "-qm", "the data with the image")
    with_image = project.run("git", "rev-parse", "HEAD").stdout.strip()
    root, shards = project.root, project.root / "data" / "shards"
    index = [json.loads(line) for line in (root / "data/ingest/index.json").open()][1:]
    # a test image: the evaluation's predictions and label review (its artifacts) name it
    record = next(r for r in index if isinstance(r, dict) and r.get("split") == "test")
    path, sha = record["path"], record["sha256"]
    source = root / "data" / "demo" / path
    before, source_bytes = records(shards), source.read_bytes()
    (seen,) = lineage(f"data/demo/{path}")
    assert seen["sha256"] == sha and seen["champion_saw_it"] and seen["runs"]
    api = project.env["PREFECT_API_URL"]
    naming = prefect_records_naming(api, path)
    held = stores.holding([source_bytes, before[sha][1], Path(path).name.encode()])
    assert any("dvc" in h for h in held)  # the searches reach the copies the build made
    assert stores.s3 is None or any(h.startswith("mlartifacts/") for h in held)
    from mlflow import MlflowClient

    client = MlflowClient(project.env["MLFLOW_TRACKING_URI"], project.env["MLFLOW_TRACKING_URI"])
    trained = client.get_run(str(client.get_model_version("shardflow", "1").run_id))
    evaluation = trained.data.tags["eval.latest_run_id"]
    assert pictures(client, evaluation)  # its evaluation's sheets, which may show it

    out = shardflow(project, "forget", f"data/demo/{path}", "--reason", "erasure request", "--json")
    erasure = json.loads(out[out.index("{") :])
    assert erasure["state"] == "done" and sha in erasure["sha256"]
    assert erasure["versions"]["retracted"] == ["1"]
    assert erasure["unrecoverable"]["commits"] == [with_image]  # its shards are gone
    gone = set(erasure["sha256"])
    after = records(shards)
    assert set(after) == set(before) - gone  # the other records, byte for byte:
    assert all(after[h] == before[h] for h in after)
    pixels = [before[h][1] for h in gone]
    names = [path.encode(), Path(path).name.encode()]
    marks = [source_bytes, *pixels, *names]
    assert files_holding([root], marks) == []
    project.dvc("push")  # what the data is now, for the clones: still nothing of it
    assert stores.holding(marks) == []

    assert api_post(api, "/artifacts/filter", {"artifacts": {"id": {"any_": [naming[0]]}}}) == []
    assert api_post(api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [naming[1]]}}}) == []
    forgotten = (root / "data/forgotten.json").read_text()
    assert sha in forgotten and Path(path).stem not in forgotten
    told = lineage(sha)
    assert told == [{"sha256": sha, "forgotten_at": erasure["at"]}]
    assert pictures(client, evaluation) == []
    champion = client.get_model_version_by_alias("shardflow", "champion")
    assert str(champion.version) == "2"
    assert (
        client.get_run(str(champion.run_id)).data.tags["data.fingerprint"]
        == load_manifest(shards).fingerprint
    )
    assert "shardflow.retracted" in client.get_model_version("shardflow", "1").tags
