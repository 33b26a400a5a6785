"""The data stages tell their story in the Prefect UI: flow runs named after what they did,
tied together by one pipeline tag, progress artifacts that reach 100 and the key figures
in the logs, all read back through the Prefect API of a real (test) server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tests.prefect_story import artifacts, flow_runs_tagged, log_lines, task_run_tags

# Every test here runs its flows on the session's Prefect server (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture
def project(tmp_path: Path, tiny_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project root with params for the tiny image folder; the working directory."""
    params = default_params(
        ingest={
            "source_dir": str(tiny_dataset),
            "splits": {"train": 0.5, "val": 0.25, "test": 0.25},
            "workers": 1,
        },
        shard={"image_size": [16, 16], "target_shard_mb": 0.002, "workers": 1},
    )
    root = tmp_path / "project"
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    monkeypatch.chdir(root)
    monkeypatch.delenv("SHARDFLOW_PIPELINE_ID", raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    return root


def run_stage(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a dvc.yaml stage runs: ``python -m flows.<module>``."""
    import importlib

    monkeypatch.setattr("sys.argv", [f"flows.{module}"])
    importlib.import_module(f"flows.{module}").main()


def test_one_pipeline_execution_reads_as_one_story(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data stages run under one workspace lock (what `make run` holds around `dvc repro`)
    share its pipeline tag; each run is named after its data and shows its progress."""
    from tasks.runtime.workspace_lock import LOCK_ENV, workspace_lock

    with workspace_lock(project, timeout_s=5):
        pipeline = f"pipeline:{os.environ[LOCK_ENV][:8]}"
        run_stage("ingest", monkeypatch)
        run_stage("shard", monkeypatch)
        run_stage("validate", monkeypatch)

    layout = Layout(project)
    report = json.loads(layout.ingest_report.read_text())
    manifest = json.loads((layout.shards_dir / "manifest.json").read_text())
    images = sum(split["num_records"] for split in manifest["splits"].values())
    assert images == report["accepted"] == 36
    figures = json.loads(layout.ingest_metrics.read_text())  # what `dvc exp show` compares
    assert figures["accepted"] == 36 and figures["split_counts"] == report["split_counts"]
    assert "counts" not in figures and "formats" not in figures  # per class: the report's
    accepted = json.loads(layout.accepted_data.read_text())["datasets"]  # a first baseline
    assert [version["fingerprint"] for version in accepted.values()] == [manifest["fingerprint"]]

    runs = flow_runs_tagged(pipeline)
    assert set(runs) == {"ingest", "shard", "write-shards", "validate"}  # nothing else
    assert "stage:ingest" in runs["ingest"].tags and "stage:shard" in runs["shard"].tags
    # Flow runs carry the tags, task runs none: a tagged task run first asks the server for
    # tag concurrency slots, which SQLite answered 503 at random (then a 2 s retry).
    for name in ("ingest", "write-shards", "validate"):
        tags = task_run_tags(runs[name].id)
        assert tags and all(t == [] for t in tags), (name, tags)
    assert runs["ingest"].name == (
        f"ingest · {report['source_dir']} · 36 of {report['files_found']} files accepted"
    )
    assert runs["shard"].name == f"shard · {manifest['fingerprint'][:8]} · {images} images"
    assert runs["validate"].name == f"validate · {manifest['fingerprint'][:8]}"
    verdict = f"validation of shards {manifest['fingerprint']} (train "
    assert any(line.startswith(verdict) for line in log_lines(runs["validate"].id))

    ingest_artifacts = artifacts(runs["ingest"].id)
    assert ingest_artifacts["ingest-progress"].data == 100
    assert "ingest-summary" in ingest_artifacts
    ingest_logs = "\n".join(log_lines(runs["ingest"].id))
    assert f"{report['files_found']} files found: 36 accepted" in ingest_logs
    assert f"in 3 classes, {report['quarantined_count']} quarantined" in ingest_logs

    written = runs["write-shards"]
    assert artifacts(written.id)["shard-progress"].data == 100
    shard_files = sum(len(split["shards"]) for split in manifest["splits"].values())
    assert shard_files > 3  # progress moved over several shards
    shard_logs = "\n".join(log_lines(written.id))
    assert f"shards {manifest['fingerprint']}: {images} records" in shard_logs
    assert f"in {shard_files} shard files, {shard_files} written now" in shard_logs
    assert f"shard {shard_files}/{shard_files} written" in shard_logs


def test_an_explicit_pipeline_id_groups_separate_commands(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stages started one by one (each takes the lock itself) share SHARDFLOW_PIPELINE_ID."""
    monkeypatch.setenv("SHARDFLOW_PIPELINE_ID", "story-7f3a")
    run_stage("ingest", monkeypatch)
    run_stage("shard", monkeypatch)
    runs = flow_runs_tagged("pipeline:story-7f3a")
    assert set(runs) == {"ingest", "shard", "write-shards"}
    assert all(tag.startswith(("stage:", "pipeline:")) for r in runs.values() for tag in r.tags)
