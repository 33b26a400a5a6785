"""Label review in a real evaluation: it finds labels flipped in the test shards (the review
itself: tests/unit/evaluate/test_label_review.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tasks.runtime.params import default_params
from tests.unit.evaluate.test_label_review import FLIPPED_TEST, flips_in_top

pytestmark = pytest.mark.slow


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_evaluation_finds_labels_flipped_in_the_test_shards(tmp_path: Path) -> None:
    """The real path: a small CNN trained on tiny shards, evaluated with the stage's core,
    ranks the test records whose labels were flipped first, in reports/label_issues.csv,
    and draws the thumbnail sheet from the shard pixels."""
    from tasks.evaluate.measurement import LABEL_SHEET, evaluate_model
    from tasks.runtime.layout import Layout
    from tasks.train.stage import train
    from tests.tiny_shards import write_tiny_shards

    write_tiny_shards(tmp_path, flipped={"val": 2, "test": 4})
    layout = Layout(tmp_path)
    no_augment = {"flip": False, "crop": 0.0, "brightness": 0.0, "contrast": 0.0}
    params = default_params(
        train={
            "epochs": 6,
            "batch_size": 16,
            "learning_rate": 3e-3,
            "early_stopping_patience": 0,
            "augment": no_augment,
        }
    ).train
    train(params, layout)
    metrics = evaluate_model(
        layout.model_file,
        layout.shards_dir,
        layout.eval_dir,
        top_k=1,
        label_issues_file=layout.label_issues,
        min_class_review_accuracy=default_params().evaluate.min_class_review_accuracy,
    )
    rows = read_rows(layout.label_issues)
    flipped = {f"{name}/test_{i:03d}.png" for name, i in FLIPPED_TEST}
    assert flips_in_top(rows, flipped, "test") >= 0.8
    found = [row for row in rows if row["split"] == "test" and row["path"] in flipped]
    # The suggestion is the colour the image is (its folder), not the label it was given.
    assert all(row["suggested_label"] == row["path"].split("/")[0] for row in found)
    assert all(row["given_label"] != row["suggested_label"] for row in found)
    assert metrics["label_review"]["reviewed"] == {"val": 18, "test": 30}
    assert (layout.eval_dir / LABEL_SHEET).stat().st_size > 0
