"""The registered pyfunc and the batch flow, on a tiny model the real stages trained."""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient

from tasks.contracts.manifest import load_manifest
from tasks.images import preprocessing_version
from tasks.runtime.tracking import using_store
from tests.prefect_story import artifacts
from tests.trained_model import MODEL_NAME, TrainedProject

# Every test here runs its flows on the session's Prefect server (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture
def project(
    trained_project: TrainedProject, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TrainedProject]:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained_project.tracking_uri)
    with using_store(trained_project.tracking_uri):  # for this test only, children included
        yield trained_project


def reference_rows(project: TrainedProject) -> list[dict[str, str]]:
    with project.test_predictions.open() as handle:
        return list(csv.DictReader(handle))


def test_pyfunc_on_the_source_files_reproduces_evaluation_exactly(project: TrainedProject) -> None:
    """No skew: the champion, fed the test split's original files, gives evaluation's answers.

    The shards are JPEG-encoded, so this holds only if serving repeats the shard round trip.
    """
    reference = reference_rows(project)
    assert len(reference) >= 5
    model = mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}@champion")
    recorded = model.metadata.metadata["preprocessing"]
    manifest = load_manifest(project.root / "data" / "shards")
    assert recorded["preprocessing_version"] == manifest.preprocessing_version
    assert recorded["preprocessing_version"] == preprocessing_version()
    assert recorded["classes"] == manifest.classes and recorded["resize"] == manifest.resize
    assert recorded["record_schema"]["encoding"] == "jpeg"
    images = [(project.source_dir / row["source"]).read_bytes() for row in reference]
    frame = model.predict(pd.DataFrame({"image": images}))
    assert list(frame["error"]) == [""] * len(reference)
    assert list(frame["label"]) == [row["predicted"] for row in reference]
    for row, score in zip(reference, frame["score"], strict=True):
        assert abs(score - float(row["score"])) <= 1e-5, row["source"]
    prob_columns = [f"p_{name}" for name in manifest.classes]
    assert (frame[prob_columns].sum(axis=1) - 1).abs().max() < 1e-5


def test_bad_images_get_an_error_and_the_batch_is_answered(project: TrainedProject) -> None:
    # a JPEG's first 40 bytes hold its signature and part of a header: truncated, not
    # unknown (a PNG's are its whole header, which Pillow then cannot open)
    reference = next(r for r in reference_rows(project) if r["source"].endswith(".jpg"))
    good = (project.source_dir / reference["source"]).read_bytes()
    model = mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}@champion")
    frame = model.predict(pd.DataFrame({"image": [b"GIF89a-not-really", good, good[:40], b""]}))
    assert list(frame["label"]) == ["", reference["predicted"], "", ""]
    assert frame["label_index"].iloc[0] == -1
    errors = list(frame["error"])
    assert "not an image" in errors[0] and errors[1] == ""
    assert "truncated or corrupt" in errors[2] and "empty file" in errors[3]


def test_batch_flow_writes_csv_artifact_and_a_linked_run(
    project: TrainedProject, tmp_path: Path
) -> None:
    from prefect.artifacts import Artifact

    from flows.predict import predict_flow

    reference = {row["source"]: row for row in reference_rows(project)}
    photos = tmp_path / "photos"
    for source in reference:
        target = photos / source
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(project.source_dir / source, target)
    (photos / "notes.txt").write_text("not an image")
    result = predict_flow(
        source=str(photos), output="out/predictions.csv", model_name=MODEL_NAME, root=str(tmp_path)
    )

    with (tmp_path / "out" / "predictions.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["path", "label", "label_index", "score", "error"]
    assert len(rows) == len(reference) + 1 == result["rows"]
    by_source = {str(Path(row["path"]).relative_to(photos)): row for row in rows}
    assert "not an image" in by_source.pop("notes.txt")["error"]
    for source, row in by_source.items():
        assert row["error"] == "" and row["label"] == reference[source]["predicted"]
        assert abs(float(row["score"]) - float(reference[source]["score"])) <= 1e-5

    client = MlflowClient(project.tracking_uri, project.tracking_uri)
    champion = client.get_model_version_by_alias(MODEL_NAME, "champion")
    run = client.get_run(result["run_id"])
    assert run.data.tags["model.name"] == MODEL_NAME
    assert run.data.tags["model.version"] == str(champion.version)
    assert run.data.tags["model.run_id"] == champion.run_id
    assert run.data.tags["predict.source"] == str(photos)
    assert run.data.metrics["num_errors"] == 1.0
    assert [a.path for a in client.list_artifacts(run.info.run_id, "predictions")] == [
        "predictions/predictions.csv"
    ]
    artifact: Any = Artifact.get("predictions")
    assert artifact is not None
    assert artifacts(artifact.flow_run_id)["predict-progress"].data == 100
    table = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    assert len(table) == len(rows)


def test_batch_flow_takes_a_csv_and_a_version_and_refuses_unknown_models(
    project: TrainedProject, tmp_path: Path
) -> None:
    from flows.predict import predict_flow

    reference = reference_rows(project)[:2]
    listing = tmp_path / "list.csv"
    listing.write_text(
        "path\n" + "".join(f"{project.source_dir / row['source']}\n" for row in reference)
    )
    result = predict_flow(
        source=str(listing), output="p.csv", model="1", model_name=MODEL_NAME, root=str(tmp_path)
    )
    with (tmp_path / "p.csv").open() as handle:
        labels = [row["label"] for row in csv.DictReader(handle)]
    assert labels == [row["predicted"] for row in reference]
    assert result["model_uri"] == f"models:/{MODEL_NAME}/1"
    with pytest.raises(LookupError, match="'staging'"):
        predict_flow(
            source=str(listing), model="staging", model_name=MODEL_NAME, root=str(tmp_path)
        )


def test_batch_flow_takes_the_relative_sqlite_uri_from_any_directory(
    trained_project: TrainedProject, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MLFLOW_TRACKING_URI=sqlite:///mlflow.db`` (MLflow's docs' form) names the project's
    store, wherever the process runs: it predicted every image, then failed to record the
    run ("relative path can't be expressed as a file URI")."""
    from flows.predict import predict_flow

    assert trained_project.tracking_uri.endswith("/mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    reference = reference_rows(trained_project)[:2]
    listing = tmp_path / "list.csv"
    listing.write_text(
        "path\n" + "".join(f"{trained_project.source_dir / row['source']}\n" for row in reference)
    )
    result = predict_flow(
        source=str(listing),
        output=str(tmp_path / "p.csv"),
        model_name=MODEL_NAME,
        root=str(trained_project.root),
    )
    assert result["rows"] == 2 and result["errors"] == 0
    client = MlflowClient(trained_project.tracking_uri)
    assert client.get_run(result["run_id"]).data.tags["model.name"] == MODEL_NAME
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.csv", "p.csv"]  # no stray store


def test_batch_flow_refuses_a_retracted_version_unless_asked_and_records_it(
    project: TrainedProject, tmp_path: Path
) -> None:
    """A copy of the champion registered under a model of its own, then retracted (the
    session's model is left as it is)."""
    from flows.predict import predict_flow
    from tasks.contracts.model_versions import Retraction, VersionRetracted

    client = MlflowClient(project.tracking_uri, project.tracking_uri)
    champion = client.get_model_version(MODEL_NAME, "1")
    client.create_registered_model("retracted-copy")
    client.create_model_version(
        "retracted-copy", champion.source, run_id=champion.run_id, tags=champion.tags
    )
    retraction = Retraction(by="ana", at="2026-12-07T09:00:00+00:00", reason="bad labels")
    for key, value in retraction.tags().items():
        client.set_model_version_tag("retracted-copy", "1", key, value)
    reference = reference_rows(project)[:1]
    listing = tmp_path / "list.csv"
    listing.write_text(f"path\n{project.source_dir / reference[0]['source']}\n")
    asked = {"source": str(listing), "output": "p.csv", "root": str(tmp_path)}
    with pytest.raises(VersionRetracted, match="retracted-copy v1 is retracted"):
        predict_flow(**asked, model="1", model_name="retracted-copy")
    result = predict_flow(**asked, model="1", model_name="retracted-copy", allow_retracted=True)
    assert result["retracted"] == retraction.in_words() and result["rows"] == 1
    tags = client.get_run(result["run_id"]).data.tags
    assert tags["predict.allow_retracted"] == "true"
    assert tags["model.retracted"] == retraction.in_words()
