"""Champion promotion against a real (SQLite) model registry."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tasks.evaluate import CHAMPION, promote

TEST_SET = "a" * 64


@dataclass
class Registry:
    client: MlflowClient
    name: str

    def decide(self, value: float, *, margin: float = 0.0, test_set: str = TEST_SET) -> Any:
        source = str(Path(self.client.tracking_uri.removeprefix("sqlite:///")).parent)
        version = str(self.client.create_model_version(self.name, source=source).version)
        return promote(
            self.client,
            self.name,
            version,
            metric="accuracy",
            value=value,
            test_fingerprint=test_set,
            margin=margin,
        )

    @property
    def champion(self) -> str:
        return str(self.client.get_model_version_by_alias(self.name, CHAMPION).version)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> MlflowClient:
    """One SQLite store for the module (creating its tables takes seconds)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('registry') / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@pytest.fixture
def registry(store: MlflowClient, request: pytest.FixtureRequest) -> Registry:
    """A fresh registered model, named after the test, in the shared store."""
    store.create_registered_model(request.node.name)
    return Registry(store, request.node.name)


def test_first_version_becomes_champion(registry: Registry) -> None:
    assert registry.decide(0.7)["promoted"] is True
    assert registry.champion == "1"


def test_worse_model_does_not_take_the_alias(registry: Registry) -> None:
    registry.decide(0.8)
    decision = registry.decide(0.7)
    assert decision["promoted"] is False
    assert decision["champion_value"] == 0.8 and decision["candidate_value"] == 0.7
    assert registry.champion == "1"


def test_better_model_takes_the_alias(registry: Registry) -> None:
    registry.decide(0.7)
    decision = registry.decide(0.8)
    assert decision["promoted"] is True and decision["comparable"] is True
    assert registry.champion == "2"


def test_gain_within_the_margin_is_not_enough(registry: Registry) -> None:
    registry.decide(0.80)
    assert registry.decide(0.82, margin=0.05)["promoted"] is False
    assert registry.champion == "1"


def test_champion_on_another_test_set_is_flagged_not_silently_compared(
    registry: Registry,
) -> None:
    registry.decide(0.7)
    decision = registry.decide(0.9, test_set="b" * 64)
    assert decision["comparable"] is False
    assert "NOT COMPARABLE" in decision["reason"]
    assert decision["promoted"] is True  # beats it anyway, and says the comparison is loose
    assert registry.champion == "2"


def test_registering_the_same_run_twice_reuses_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried or repeated evaluation must not add a duplicate registry version."""
    import keras

    from tasks.evaluate import register_model

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    runs = [client.create_run(experiment).info.run_id for _ in range(2)]
    from tasks.predict import ServingSpec
    from tasks.schema import RecordSchema

    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Flatten(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model_file = tmp_path / "m.keras"
    model.save(model_file)
    spec = ServingSpec(RecordSchema(8, 8, "raw").to_dict(), "pad", ["a", "b"], "v", 10**6, 1, 10**6)
    first = register_model(client, runs[0], model_file, "m", spec)
    again = register_model(client, runs[0], model_file, "m", spec)
    other = register_model(client, runs[1], model_file, "m", spec)
    assert first == again == "1" and other == "2"
