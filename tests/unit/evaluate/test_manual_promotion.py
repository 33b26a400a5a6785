"""`shardflow promote`: the one recorded manual move of the champion alias (a real registry)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from flows.cli import promote as promote_command
from tasks.contracts.model_versions import Retraction
from tasks.evaluate.manual_promotion import PromotionRefused, Task, promote_by_hand
from tasks.evaluate.promotion import CLASSES_TAG
from tasks.evaluate.registry import registered_spec
from tasks.runtime.params import shipped_params_text
from tasks.runtime.refusals import Refused
from tasks.runtime.tracking import CHAMPION, champion_version

SCHEMA = {"height": 32, "width": 32, "channels": 3, "encoding": "raw"}
SPEC = {
    "record_schema": SCHEMA,
    "resize": "pad",
    "draft_decode": True,
    "preprocessing_version": "p1",
}
SHAPES = Task(("circle", "square", "star"), SPEC)


def register(client: MlflowClient, folder: Path, classes: list[str], spec: dict) -> str:  # type: ignore[type-arg]
    """A version of ``shardflow`` whose MLmodel records ``spec`` and whose tags ``classes``."""
    folder.mkdir(parents=True)
    metadata = {"preprocessing": {**spec, "classes": classes}}
    (folder / "MLmodel").write_text(yaml.safe_dump({"metadata": metadata}))
    version = str(client.create_model_version("shardflow", source=str(folder)).version)
    client.set_model_version_tag("shardflow", version, CLASSES_TAG, json.dumps(classes))
    return version


@pytest.fixture
def registry(tmp_path: Path, mlflow_store: str) -> MlflowClient:
    """``shardflow`` (the demo data's model): v1 champion of circle/square, v2 the same task
    (a class added), v3 of another task, v4 of the same classes at another image size."""
    client = MlflowClient(mlflow_store, mlflow_store)
    client.create_registered_model("shardflow")
    other_size = {**SPEC, "record_schema": {**SCHEMA, "height": 64, "width": 64}}
    for n, (classes, spec) in enumerate(
        [
            (["circle", "square"], SPEC),
            (["circle", "square", "star"], SPEC),
            (["cat", "coffee"], SPEC),
            (["circle", "square", "star"], other_size),
        ]
    ):
        register(client, tmp_path / f"v{n + 1}", classes, spec)
    client.set_registered_model_alias("shardflow", CHAMPION, "1")
    return client


def by_hand(client: MlflowClient, version: str, reason: str = "r", task: Task | None = SHAPES):  # type: ignore[no-untyped-def]
    spec = registered_spec(client, "shardflow", version) if version != "9" else None
    return promote_by_hand(
        client,
        "shardflow",
        version,
        reason=reason,
        by="ana",
        min_shared_class_share=0.5,
        task=task,
        version_spec=spec,
    )


def test_a_manual_promotion_moves_the_alias_and_records_who_when_why(
    registry: MlflowClient,
) -> None:
    done = by_hand(registry, "2", reason="holds up on March")
    assert champion_version(registry, "shardflow") == "2" and done.previous == "1"
    tags = registry.get_model_version("shardflow", "2").tags
    assert tags["promotion.manual.by"] == "ana"
    assert tags["promotion.manual.reason"] == "holds up on March"
    assert tags["promotion.manual.previous_champion"] == "1"
    assert tags["promotion.manual.at"] == done.at and done.at.endswith("+00:00")


@pytest.mark.parametrize(
    ("version", "reason", "says"),
    [
        ("3", "looks fine", "another task: it has 0% of the classes of the current shards"),
        ("9", "looks fine", "has no version 9; its versions: 4, 3, 2, 1"),
        ("2", "  ", "needs a reason"),
        ("4", "looks fine", r"another task: .*height=64, width=64.* \(v4\) vs height=32"),
    ],
    ids=["another-task", "no-such-version", "no-reason", "another-image-size"],
)
def test_a_manual_promotion_is_refused_naming_why(
    registry: MlflowClient, version: str, reason: str, says: str
) -> None:
    with pytest.raises(PromotionRefused, match=says) as refused:
        by_hand(registry, version, reason)
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


@pytest.mark.parametrize("version", ["3", "4"], ids=["other-classes", "other-image-size"])
def test_without_a_champion_a_version_of_another_task_is_still_refused(
    registry: MlflowClient, version: str
) -> None:
    registry.delete_registered_model_alias("shardflow", CHAMPION)
    with pytest.raises(PromotionRefused, match=f"v{version} is of another task"):
        by_hand(registry, version)
    assert champion_version(registry, "shardflow") is None
    with pytest.raises(PromotionRefused, match="no champion and no shards"):
        by_hand(registry, "2", task=None)  # nothing to check it against
    assert by_hand(registry, "2").version == "2"


def test_a_retracted_version_is_refused_naming_the_erasure(registry: MlflowClient) -> None:
    retraction = Retraction(
        by="forget",
        at="2026-12-07T09:00:00+00:00",
        reason="consent withdrawn",
        erasure="2026-12-07T08:59:00+00:00",
    )
    for key, value in retraction.tags().items():
        registry.set_model_version_tag("shardflow", "2", key, value)
    with pytest.raises(
        PromotionRefused,
        match=r"v2 is retracted .* by the erasure of "
        r"2026-12-07T08:59:00\+00:00 recorded in data/forgotten.json",
    ):
        by_hand(registry, "2")
    assert champion_version(registry, "shardflow") == "1"
