"""`shardflow promote`: the one recorded manual move of the champion alias (a real registry)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows import promote as promote_command
from tasks.evaluate.manual_promotion import PromotionRefused, promote_by_hand
from tasks.evaluate.promotion import CLASSES_TAG
from tasks.runtime.params import shipped_params_text
from tasks.runtime.refusals import Refused
from tasks.runtime.tracking import CHAMPION, champion_version


@pytest.fixture
def registry(tmp_path: Path, mlflow_uri: str) -> MlflowClient:
    """``shardflow`` (the demo data's model): v1 champion of circle/square, v2 the same task
    (a class added), v3 of another task."""
    client = MlflowClient(mlflow_uri, mlflow_uri)
    client.create_registered_model("shardflow")
    for classes in (["circle", "square"], ["circle", "square", "star"], ["cat", "coffee"]):
        version = client.create_model_version("shardflow", source=str(tmp_path)).version
        client.set_model_version_tag("shardflow", version, CLASSES_TAG, json.dumps(classes))
    client.set_registered_model_alias("shardflow", CHAMPION, "1")
    return client


def test_a_manual_promotion_moves_the_alias_and_records_who_when_why(
    registry: MlflowClient,
) -> None:
    done = promote_by_hand(
        registry, "shardflow", "2", reason="holds up on March", by="ana", min_shared_class_share=0.5
    )
    assert champion_version(registry, "shardflow") == "2" and done.previous == "1"
    tags = registry.get_model_version("shardflow", "2").tags
    assert tags["promotion.manual.by"] == "ana"
    assert tags["promotion.manual.reason"] == "holds up on March"
    assert tags["promotion.manual.previous_champion"] == "1"
    assert tags["promotion.manual.at"] == done.at and done.at.endswith("+00:00")


@pytest.mark.parametrize(
    ("version", "reason", "says"),
    [
        ("3", "looks fine", "another task: it has 0% of champion v1's classes"),
        ("9", "looks fine", "has no version 9; its versions: 3, 2, 1"),
        ("2", "  ", "needs a reason"),
    ],
    ids=["another-task", "no-such-version", "no-reason"],
)
def test_a_manual_promotion_is_refused_naming_why(
    registry: MlflowClient, version: str, reason: str, says: str
) -> None:
    with pytest.raises(PromotionRefused, match=says) as refused:
        promote_by_hand(
            registry, "shardflow", version, reason=reason, by="ana", min_shared_class_share=0.5
        )
    assert isinstance(refused.value, Refused) and refused.value.fix
    assert champion_version(registry, "shardflow") == "1"
    assert "promotion.manual.by" not in registry.get_model_version("shardflow", "2").tags


def test_the_command_promotes_in_the_current_dataset_s_model(
    registry: MlflowClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "params.yaml").write_text(shipped_params_text())
    args = ["--root", str(tmp_path), "--version", "3", "--reason", "r", "--by", "ana"]
    assert promote_command.main(args) == 2  # another task: refused, with its fix
    err = capsys.readouterr().err
    assert "another task" in err and "fix:" in err
    assert promote_command.main([*args[:3], "2", "--reason", "r", "--by", "ana"]) == 0
    assert "shardflow@champion is v2 (was v1), by ana" in capsys.readouterr().out
