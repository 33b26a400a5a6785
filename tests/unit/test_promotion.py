"""Promotion and the evaluate stage refusals, against a real (SQLite) registry."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tasks.atomic import write_json
from tasks.evaluate import (
    CHAMPION,
    apply_decision,
    champion_version,
    decide,
    pending_decision,
    run_evaluate,
)
from tasks.gate import ModelNotFromTheseShards, ShardsNotValidated
from tasks.layout import Layout
from tasks.params import default_params

TEST_SET = "a" * 64


@dataclass
class Registry:
    client: MlflowClient
    name: str

    def decide(
        self,
        value: float,
        *,
        margin: float = 0.0,
        test_set: str = TEST_SET,
        allow_incomparable: bool = False,
    ) -> Any:
        source = str(Path(self.client.tracking_uri.removeprefix("sqlite:///")).parent)
        version = str(self.client.create_model_version(self.name, source=source).version)
        decision = decide(
            self.client,
            self.name,
            version,
            metric="accuracy",
            value=value,
            test_fingerprint=test_set,
            margin=margin,
            allow_incomparable=allow_incomparable,
        )
        apply_decision(self.client, self.name, decision)  # as run_evaluate does, after writing
        return decision

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


def test_champion_on_another_test_set_is_kept_not_silently_compared(
    registry: Registry,
) -> None:
    registry.decide(0.7)
    decision = registry.decide(0.9, test_set="b" * 64)
    assert decision["comparable"] is False and decision["promoted"] is False
    assert decision["decision"] == "not comparable: champion kept"
    assert "evaluate.allow_incomparable_promotion" in decision["reason"]
    assert registry.champion == "1"


def test_incomparable_promotion_only_when_the_param_allows_it(registry: Registry) -> None:
    registry.decide(0.7)
    decision = registry.decide(0.9, test_set="b" * 64, allow_incomparable=True)
    assert decision["comparable"] is False and decision["promoted"] is True
    assert "NOT COMPARABLE" in decision["reason"]
    assert registry.champion == "2"


def test_champion_without_a_figure_is_not_comparable(registry: Registry) -> None:
    registry.decide(0.7)
    registry.client.delete_model_version_tag(registry.name, "1", "eval.accuracy")
    decision = registry.decide(0.9)
    assert decision["comparable"] is False and decision["promoted"] is False
    assert decision["champion_value"] is None
    assert registry.champion == "1"


def test_negative_margin_is_refused(registry: Registry) -> None:
    registry.decide(0.8)
    with pytest.raises(ValueError, match=r"evaluate\.promotion_margin=-0\.1"):
        registry.decide(0.75, margin=-0.1)
    assert registry.champion == "1"


def model_to_register(tmp_path: Path) -> tuple[Path, Any]:
    """A saved two-class Keras model and a serving spec for it."""
    import keras

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
    spec = ServingSpec(
        RecordSchema(8, 8, "raw").to_dict(), "pad", True, ["a", "b"], "v", 10**6, 1, 10**6
    )
    return model_file, spec


def store_with_runs(tmp_path: Path, name: str, runs: int) -> tuple[MlflowClient, list[str]]:
    uri = f"sqlite:///{tmp_path / name}"
    client = MlflowClient(uri, uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    return client, [client.create_run(experiment).info.run_id for _ in range(runs)]


def test_registering_the_same_run_twice_reuses_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried or repeated evaluation must not add a duplicate registry version."""
    from tasks.evaluate import register_model

    client, runs = store_with_runs(tmp_path, "mlflow.db", 2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
    model_file, spec = model_to_register(tmp_path)
    first = register_model(client, runs[0], model_file, "m", spec)
    again = register_model(client, runs[0], model_file, "m", spec)
    other = register_model(client, runs[1], model_file, "m", spec)
    assert first == again == "1" and other == "2"


def test_registering_leaves_the_process_and_the_run_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registering in the client's store must not point the process, or the children it
    starts later, at that store (their ``models:/m@champion`` would resolve there), nor end
    the run that evaluation is still logging to."""
    import mlflow

    from tasks.evaluate import register_model

    client, runs = store_with_runs(tmp_path, "project.db", 1)
    own = f"sqlite:///{tmp_path / 'own.db'}"  # the store this process is configured for
    monkeypatch.setenv("MLFLOW_TRACKING_URI", own)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    before = (mlflow.get_tracking_uri(), mlflow.get_registry_uri())
    model_file, spec = model_to_register(tmp_path)

    assert register_model(client, runs[0], model_file, "m", spec) == "1"

    assert client.get_model_version("m", "1").run_id == runs[0]  # in the client's store
    assert (mlflow.get_tracking_uri(), mlflow.get_registry_uri()) == before == (own, own)
    assert os.environ["MLFLOW_TRACKING_URI"] == own
    assert "MLFLOW_REGISTRY_URI" not in os.environ
    # Evaluation goes on logging to the run: it must not look finished yet, nor stay active.
    assert client.get_run(runs[0]).info.status == "RUNNING"
    assert mlflow.active_run() is None


# -- the evaluate stage: refusals, fair comparison and crash recovery ------------------------


@pytest.fixture
def model_root(tiny_shards: Path, mlflow_uri: str) -> Layout:
    """A project root as train leaves it, but no tracking store: the refusals need none.

    The model is untrained (evaluation does not care how good it is), which keeps this fast.
    """
    from tasks.manifest import load_manifest
    from tasks.models import build_model

    layout = Layout(tiny_shards)
    manifest = load_manifest(layout.shards_dir)
    layout.model_dir.mkdir(parents=True, exist_ok=True)
    build_model(default_params().train, len(manifest.classes), (16, 16, 3)).save(layout.model_file)
    write_json(layout.train_run, {"run_id": "not-opened", "fingerprint": manifest.fingerprint})
    return layout


@pytest.fixture
def trained(model_root: Layout) -> Layout:
    """``model_root`` plus the finished training run its run.json names, in a real store."""
    from tasks import tracking

    client = tracking.client(model_root.root)
    run_id = client.create_run(tracking.experiment_id(client)).info.run_id
    client.set_terminated(run_id)
    record = json.loads(model_root.train_run.read_text())
    write_json(model_root.train_run, {**record, "run_id": run_id})
    return model_root


def refused(layout: Layout) -> bool:
    """Nothing evaluated, nothing tracked."""
    return not layout.eval_metrics.exists() and not (layout.root / "mlflow.db").exists()


def evaluate(layout: Layout, **settings: Any) -> dict[str, Any]:
    """Evaluate with some settings changed; model_copy skips validation, so evaluate's own
    refusals (a negative margin) are exercised too, not only the params file's."""
    base = default_params(evaluate={"model_name": "m"})
    section = base.evaluate.model_copy(update=settings)
    return run_evaluate(base.model_copy(update={"evaluate": section}), layout)


def test_model_trained_on_other_shards_is_refused(model_root: Layout) -> None:
    record = json.loads(model_root.train_run.read_text())
    write_json(model_root.train_run, {**record, "fingerprint": "f" * 64})
    with pytest.raises(ModelNotFromTheseShards, match=r"run\.json.*trained on shards ffffff"):
        evaluate(model_root)
    assert refused(model_root)


def test_evaluation_refuses_unvalidated_shards(model_root: Layout) -> None:
    model_root.validation_report.unlink()
    with pytest.raises(ShardsNotValidated, match="no validation report"):
        evaluate(model_root)
    assert refused(model_root)


def test_evaluation_refuses_a_same_size_edit_after_validation(model_root: Layout) -> None:
    shard = sorted(model_root.shards_dir.glob("test.tfrecord-*"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardsNotValidated, match=rf"{shard.name}.*sha256"):
        evaluate(model_root)
    assert refused(model_root)


def test_evaluation_refuses_a_negative_margin(model_root: Layout) -> None:
    with pytest.raises(ValueError, match=r"evaluate\.promotion_margin=-0\.01"):
        evaluate(model_root, promotion_margin=-0.01)
    assert refused(model_root)


def test_incomparable_champion_is_kept_and_the_record_says_so(
    trained: Layout, mlflow_uri: str
) -> None:
    client = MlflowClient(mlflow_uri, mlflow_uri)
    client.create_registered_model("m")
    old = client.create_model_version("m", source=str(trained.root)).version
    client.set_model_version_tag("m", old, "eval.accuracy", "0.0")  # any candidate beats it
    client.set_model_version_tag("m", old, "eval.test_fingerprint", "b" * 64)
    client.set_registered_model_alias("m", CHAMPION, old)

    result = evaluate(trained)
    recorded = json.loads(trained.eval_summary.read_text())["promotion"]
    assert recorded == result["promotion"]
    assert recorded["promoted"] is False and recorded["comparable"] is False
    assert recorded["decision"] == "not comparable: champion kept"
    tags = client.get_run(result["run_id"]).data.tags
    assert tags["promotion.decision"] == "not comparable: champion kept"
    assert tags["promotion.comparable"] == "false"
    assert client.get_model_version_by_alias("m", CHAMPION).version == old


def test_rerun_after_a_crash_between_record_and_alias_completes_the_move(
    trained: Layout, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = MlflowClient(mlflow_uri, mlflow_uri)
    real = MlflowClient.set_registered_model_alias
    crashes: list[str] = []

    def crash_once(self: MlflowClient, name: str, alias: str, version: str) -> None:
        if not crashes:
            crashes.append(version)
            raise RuntimeError("killed between the record and the alias move")
        real(self, name, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", crash_once)
    with pytest.raises(RuntimeError, match="killed"):
        evaluate(trained)
    recorded = json.loads(trained.eval_summary.read_text())  # beside the numeric metrics
    assert recorded["promotion"]["promoted"] is True and recorded["model_version"] == "1"
    assert champion_version(client, "m") is None  # the decision is on disk, the alias is not

    result = evaluate(trained)
    assert crashes == ["1"]
    assert result["model_version"] == "1" and result["promotion"] == recorded["promotion"]
    assert champion_version(client, "m") == "1"


def test_recorded_decision_is_pending_only_while_the_alias_has_not_moved(tmp_path: Path) -> None:
    path = tmp_path / "eval_summary.json"
    decision = {"metric": "accuracy", "promoted": True, "champion_version": "1"}
    write_json(path, {"run_id": "r", "model_version": "2", "promotion": decision})

    def pending(run_id: str = "r", version: str = "2", champion: str | None = "1") -> Any:
        return pending_decision(
            path, run_id=run_id, version=version, metric="accuracy", champion=champion
        )

    assert pending() == decision  # crashed before the move: complete it
    assert pending(champion="2") == decision  # moved already: completing is a no-op
    assert pending(champion="3") is None  # another version took it since: decide afresh
    assert pending(run_id="other") is None and pending(version="3") is None
    write_json(
        path, {"run_id": "r", "model_version": "2", "promotion": {**decision, "promoted": False}}
    )
    assert pending() is None
