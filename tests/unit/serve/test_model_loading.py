"""A model is what it says it is: an alias resolved once, a version loaded by number, its
Keras file checked against the sha256 recorded at registration, a retracted one refused
(a real SQLite registry; the pyfunc loader itself is replaced: no TensorFlow here)."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from tasks.contracts.model_versions import (
    MODEL_SHA256_TAG,
    ModelFileAltered,
    Retraction,
    VersionRetracted,
    file_sha256,
)
from tasks.serve.batch_prediction import load_pyfunc, resolve_model

KERAS_PATH = "artifacts/model.keras"


def log_fake_model(client: MlflowClient, experiment: str, content: bytes) -> tuple[str, Path]:
    """A run holding an MLflow model folder whose Keras file is ``content``; the run id and
    the stored file."""
    run_id = client.create_run(experiment).info.run_id
    folder = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://")) / "model"
    (folder / "artifacts").mkdir(parents=True)
    (folder / KERAS_PATH).write_bytes(content)
    conf = {"flavors": {"python_function": {"artifacts": {"keras_model": {"path": KERAS_PATH}}}}}
    (folder / "MLmodel").write_text(yaml.safe_dump(conf))
    return run_id, folder / KERAS_PATH


@pytest.fixture
def registry(
    tmp_path: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[MlflowClient, list[Path]]:
    """Model ``m``: v1 and v2, each recording its file's sha256; v1 champion. The pyfunc
    loader returns the folder it was asked to load."""
    client = MlflowClient(mlflow_store, mlflow_store)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    client.create_registered_model("m")
    stored = []
    for content in (b"version one's weights", b"version two's weights"):
        run_id, path = log_fake_model(client, experiment, content)
        client.create_model_version(
            "m", f"runs:/{run_id}/model", run_id=run_id, tags={MODEL_SHA256_TAG: file_sha256(path)}
        )
        stored.append(path)
    client.set_registered_model_alias("m", "champion", "1")
    monkeypatch.setattr(mlflow.pyfunc, "load_model", lambda where: Path(where))
    return client, stored


def test_an_alias_moved_after_it_was_resolved_still_loads_the_version_resolved(
    registry: tuple[MlflowClient, list[Path]],
) -> None:
    client, _ = registry
    ref = resolve_model(client, "champion", "m")
    client.set_registered_model_alias("m", "champion", "2")  # between resolve and load
    loaded, retracted = load_pyfunc(client, ref)
    assert (ref.version, ref.alias, ref.uri) == ("1", "champion", "models:/m/1")
    assert (Path(loaded) / KERAS_PATH).read_bytes() == b"version one's weights"
    assert retracted is None


@pytest.mark.parametrize(
    "tamper",
    [
        lambda stored: stored[0].write_bytes(stored[1].read_bytes()),
        lambda stored: stored[0].write_bytes(stored[0].read_bytes()[:5]),
    ],
    ids=["another-version-s-file", "truncated"],
)
def test_a_model_file_that_is_not_the_one_registered_is_refused_naming_the_version(
    registry: tuple[MlflowClient, list[Path]], tamper: object
) -> None:
    client, stored = registry
    tamper(stored)  # type: ignore[operator]
    with pytest.raises(ModelFileAltered, match=r"Keras file of m v1 .* not the .* recorded") as err:
        load_pyfunc(client, resolve_model(client, "1", "m"))
    assert "shardflow retract --version 1" in str(err.value.fix)
    loaded, _ = load_pyfunc(client, resolve_model(client, "2", "m"))  # v2 is untouched
    assert (Path(loaded) / KERAS_PATH).read_bytes() == b"version two's weights"


def test_a_retracted_version_loads_only_when_asked_and_says_so(
    registry: tuple[MlflowClient, list[Path]],
) -> None:
    client, _ = registry
    retraction = Retraction(by="ana", at="2026-12-07T09:00:00+00:00", reason="bad labels")
    for key, value in retraction.tags().items():
        client.set_model_version_tag("m", "2", key, value)
    with pytest.raises(VersionRetracted, match=r"m v2 is retracted .* by ana: bad labels") as err:
        load_pyfunc(client, resolve_model(client, "2", "m"))
    assert "--allow-retracted" in str(err.value.fix)
    _, retracted = load_pyfunc(client, resolve_model(client, "2", "m"), allow_retracted=True)
    assert retracted == retraction.in_words()
