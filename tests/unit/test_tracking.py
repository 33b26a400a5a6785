"""Tracking setup and what a training run records about its data."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks import tracking
from tasks.manifest import load_manifest
from tasks.params import default_params


def test_tracking_uri_prefers_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking.tracking_uri("/x") == "http://mlflow:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking.tracking_uri("/x") == "sqlite:////x/mlflow.db"


def test_dvc_hash_comes_from_the_shard_stage_outs(tmp_path: Path) -> None:
    assert tracking.dvc_shards_md5(tmp_path) == "untracked"
    lock = {
        "schema": "2.0",
        "stages": {
            "shard": {
                "outs": [{"path": "data/shards", "md5": "abc123.dir", "size": 10, "nfiles": 3}]
            }
        },
    }
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert tracking.dvc_shards_md5(tmp_path) == "abc123.dir"


def test_train_run_records_params_lineage_and_dataset(tiny_shards: Path, mlflow_uri: str) -> None:
    manifest = load_manifest(tiny_shards / "data" / "shards")
    params = default_params(train={"epochs": 4, "batch_size": 8, "learning_rate": 0.01})
    client = tracking.client(tiny_shards)
    run_id = tracking.start_train_run(
        client,
        params,
        manifest,
        shards_dir=tiny_shards / "data" / "shards",
        root=tiny_shards,
        device_tags={"device.type": "cpu"},
    )
    run = client.get_run(run_id)
    assert run.info.run_name == f"small_cnn-e4-bs8-lr0.01-{manifest.fingerprint[:8]}"
    assert run.data.params["train.epochs"] == "4"
    assert run.data.params["train.augment.flip"] == "True"
    assert run.data.params["shard.image_size"] == "(64, 64)"
    assert run.data.params["data.schema.height"] == "16"
    assert run.data.tags["data.fingerprint"] == manifest.fingerprint
    assert run.data.tags["data.dvc_md5"] == "untracked"
    assert run.data.tags["device.type"] == "cpu"
    assert run.data.metrics["data.test_records"] == 30
    assert run.inputs is not None
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == f"shards@{manifest.fingerprint[:12]}"
    assert manifest.fingerprint.startswith(dataset.dataset.digest)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == tracking.EXPERIMENT_NAME
    assert experiment.artifact_location.startswith((tiny_shards / "mlartifacts").as_uri())


def test_run_url_links_the_ui_page_of_the_run(tiny_shards: Path, mlflow_uri: str) -> None:
    manifest = load_manifest(tiny_shards / "data" / "shards")
    client = tracking.client(tiny_shards)
    run_id = tracking.start_train_run(
        client,
        default_params(),
        manifest,
        shards_dir=tiny_shards / "data" / "shards",
        root=tiny_shards,
    )
    experiment = client.get_run(run_id).info.experiment_id
    url = tracking.run_url(client, run_id)
    assert url.startswith(f"{tracking.MLFLOW_UI_URL}/#/experiments/{experiment}/runs/{run_id}")
    assert mlflow_uri in url  # says which store `make ui` must serve
    # Outside a Prefect flow there is no flow run to link back to.
    assert client.get_run(run_id).data.tags["prefect.flow_run_url"] == "none"
