"""What a shard run changed (record by record), and the params limits that fail validation and
training when the change from the accepted data version exceeds them."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.contracts.index import load_index
from tasks.runtime.params import ValidateParams, default_params
from tasks.train.stage import ShardsNotValidated, check_validated
from tasks.validate.stage import run_validate
from tests.unit.shard.test_append import Project, add_images

# What validation reports, not how it runs its TensorFlow cross-check (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cross_check_in_process")


def limits(**changes: Any) -> ValidateParams:
    """The data gate's limits of params.yaml with ``changes``."""
    return default_params(validate=changes).validate_


@pytest.fixture
def changed(tmp_path: Path) -> tuple[Project, list[str], str]:
    """Base of 3 classes x 8, then 6 images of a new class and one copied image appended."""
    project = Project(tmp_path)
    project.update("rebuild")
    added = add_images(project.source, "amber", 6, seed=7)
    copy = "red/00-copy.png"  # sorts before red/001.png, so ingest keeps this name
    shutil.copy(project.source / "red" / "001.png", project.source / copy)
    project.update("append")
    return project, added, copy


def diff_of(project: Project) -> dict[str, Any]:
    return json.loads((project.root / "diff.json").read_text())


def validate(project: Project, limits: ValidateParams) -> dict[str, Any]:
    reports = project.root / "reports"
    return run_validate(
        project.shards,
        reports / "validation.json",
        reports / "validation.md",
        index_path=project.index,
        accepted_path=project.root / "accepted.json",
        diff_path=reports / "data_diff.json",
        limits=limits,
        dataset="images",
    )


def test_diff_counts_a_crafted_change(changed: tuple[Project, list[str], str]) -> None:
    project, added, copy = changed
    diff = diff_of(project)
    index = load_index(project.index)
    split_of = {r["path"]: r["split"] for r in index["records"]}
    want = Counter(split_of[p] for p in added)
    assert diff["added"] == {
        s: ({"amber": want[s]} if want[s] else {}) for s in ("train", "val", "test")
    }
    assert diff["added_total"] == 6 and diff["removed_total"] == 0
    assert diff["records"] == {"before": 24, "after": 30}
    assert diff["new_classes"] == ["amber"]
    assert diff["class_share"]["amber"] == {"before": 0.0, "after": 0.2, "shift": 0.2}
    assert diff["class_share"]["red"]["shift"] == pytest.approx(8 / 30 - 1 / 3, abs=1e-6)
    assert diff["largest_share_shift"] == {"class": "amber", "shift": 0.2}
    assert diff["duplicates"] == [{"path": copy, "same_content_as": "red/001.png"}]
    # amber images are 20-26 px wide and 24 px high: the width quantiles drop
    assert diff["image_size"]["after"]["width"][0] <= diff["image_size"]["before"]["width"][0]
    summary = (project.root / "diff.md").read_text()
    assert "| amber |" in summary and "+0.200" in summary


def rebuilt_after(
    tmp_path: Path, label: str, change: Callable[[Path], object]
) -> tuple[Project, dict[str, Any], Counter[str]]:
    """Rebuild, ``change`` three images of ``label``, rebuild: the project, its diff and the
    changed images per split."""
    project = Project(tmp_path)
    project.update("rebuild")
    picked = [r for r in load_index(project.index)["records"] if r["label"] == label][:3]
    for record in picked:
        change(project.source / record["path"])
    project.update("rebuild")
    return project, diff_of(project), Counter(r["split"] for r in picked)


def test_diff_counts_removals_after_a_rebuild(tmp_path: Path) -> None:
    _, diff, want = rebuilt_after(tmp_path, "blue", Path.unlink)
    assert {s: n.get("blue", 0) for s, n in diff["removed"].items()} == {
        s: want.get(s, 0) for s in ("train", "val", "test")
    }
    assert diff["removed_total"] == 3 and diff["added_total"] == 0 and diff["generations"] == 1


def test_thresholds_fail_validation_and_training_refuses(tmp_path: Path) -> None:
    strict = limits(max_class_share_shift=0.1, allow_new_classes=False)
    project = Project(tmp_path)
    project.update("rebuild")
    assert validate(project, strict)["passed"]  # the accepted version
    add_images(project.source, "amber", 6, seed=7)
    project.update("append")
    refused = validate(project, strict)
    failed = {c["name"]: c["message"] for c in refused["checks"] if not c["passed"]}
    assert list(failed) == ["data_diff"]
    assert "allow_new_classes" in failed["data_diff"]
    assert (
        "'amber' share moved" in failed["data_diff"]
        and "max_class_share_shift" in (failed["data_diff"])
    )
    with pytest.raises(ShardsNotValidated, match="data_diff"):
        check_validated(project.shards, project.root / "reports" / "validation.json")

    accepting = validate(project, limits(max_class_share_shift=0.25, allow_new_classes=True))
    assert accepting["passed"]
    manifest = check_validated(project.shards, project.root / "reports" / "validation.json")
    assert len(manifest.generations) == 2


def test_a_relabel_is_removed_from_one_class_and_added_to_the_other(tmp_path: Path) -> None:
    def to_blue(path: Path) -> None:
        path.rename(path.parent.parent / "blue" / f"was-red-{path.name}")

    project, diff, want = rebuilt_after(tmp_path, "red", to_blue)
    assert diff["moved_total"] == diff["added_total"] == diff["removed_total"] == 3
    assert {s: n.get("blue", 0) for s, n in diff["added"].items()} == {
        s: want.get(s, 0) for s in ("train", "val", "test")
    }
    assert {s: n.get("red", 0) for s, n in diff["removed"].items()} == {
        s: want.get(s, 0) for s in ("train", "val", "test")
    }
    assert diff["class_share"]["blue"]["shift"] == pytest.approx(3 / 24, abs=1e-6)
    assert (
        "moved to another class or split (in both counts): 3"
        in (project.root / "diff.md").read_text()
    )
