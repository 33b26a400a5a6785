"""Retraction is a state of the version: no alias stays on it, its tags and description say
who or which erasure retracted it (a real SQLite registry)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.cli import retract as retract_command
from tasks.contracts.forgotten import Erasure
from tasks.contracts.model_versions import (
    RETRACTED_BY_TAG,
    RETRACTED_ERASURE_TAG,
    RETRACTED_REASON_TAG,
    Retraction,
)
from tasks.erasure.retraction import RetractionRefused, retract_by_hand, retract_versions
from tasks.evaluate.model_card import RETRACTION_HEADING
from tasks.runtime.tracking import CHALLENGER, CHAMPION

SHA = "ab" * 32
ERASURE = Erasure(
    sha256=[SHA, "cd" * 32],
    asked=[SHA],
    by="ana",
    at="2026-12-07T08:59:00+00:00",
    reason="consent withdrawn",
    models="retrain",
)


@pytest.fixture
def registry(tmp_path: Path, mlflow_store: str) -> MlflowClient:
    """``shardflow`` v1 champion and ``staging``, v2 challenger, v3 unaliased; v1's card."""
    client = MlflowClient(mlflow_store, mlflow_store)
    client.create_registered_model("shardflow")
    for _ in range(3):
        client.create_model_version("shardflow", source=str(tmp_path))
    client.update_model_version("shardflow", "1", "Version 1 scored test accuracy 0.9.")
    client.set_registered_model_alias("shardflow", CHAMPION, "1")
    client.set_registered_model_alias("shardflow", "staging", "1")
    client.set_registered_model_alias("shardflow", CHALLENGER, "2")
    return client


def test_an_erasure_takes_every_alias_and_names_itself_by_its_record(
    registry: MlflowClient,
) -> None:
    retraction = Retraction(
        "ana", ERASURE.at, ERASURE.reason, erasure=ERASURE.at, images=len(ERASURE.sha256)
    )
    done = retract_versions(registry, "shardflow", ["2", "1"], retraction, delete=False)
    assert done == ["1", "2"]
    model = registry.get_registered_model("shardflow")
    assert model.aliases == {}  # champion, challenger and staging all left
    v1 = registry.get_model_version("shardflow", "1")
    assert v1.tags[RETRACTED_ERASURE_TAG] == ERASURE.at
    card = v1.description
    assert card.startswith(RETRACTION_HEADING) and card.endswith("scored test accuracy 0.9.")
    assert (
        "erasure of 2026-12-07T08:59:00+00:00 recorded in data/forgotten.json "
        "(reason: consent withdrawn; 2 images forgotten)" in card
    )
    assert SHA not in card and SHA not in str(v1.tags)  # a hash is a mark to erase
    retract_versions(registry, "shardflow", ["1"], retraction, delete=False)
    assert registry.get_model_version("shardflow", "1").description.count(RETRACTION_HEADING) == 1


def test_a_retraction_by_hand_is_recorded_like_a_promotion(registry: MlflowClient) -> None:
    removed = retract_by_hand(
        registry, "shardflow", "1", reason="mislabelled", by="bo", at="2026-12-07T09:10:00+00:00"
    )
    assert sorted(removed) == [CHAMPION, "staging"]
    v1 = registry.get_model_version("shardflow", "1")
    assert (v1.tags[RETRACTED_BY_TAG], v1.tags[RETRACTED_REASON_TAG]) == ("bo", "mislabelled")
    assert "Retracted 2026-12-07T09:10:00+00:00 by bo: mislabelled" in v1.description
    assert registry.get_registered_model("shardflow").aliases == {CHALLENGER: 2}
    with pytest.raises(RetractionRefused, match="no version 9"):
        retract_by_hand(registry, "shardflow", "9", reason="x", by="bo", at="now")
    with pytest.raises(RetractionRefused, match="needs a reason"):
        retract_by_hand(registry, "shardflow", "3", reason=" ", by="bo", at="now")


def test_the_command_retracts_in_the_current_dataset_s_model(
    registry: MlflowClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(__file__).resolve().parents[3]
    (tmp_path / "params.yaml").write_text((root / "params.yaml").read_text())
    args = ["--root", str(tmp_path), "--version", "1", "--reason", "bad", "--by", "bo"]
    assert retract_command.main(args) == 0
    out = capsys.readouterr().out
    assert "shardflow v1 is retracted" in out and "has no champion now" in out
    assert CHAMPION not in registry.get_registered_model("shardflow").aliases
