"""DVC metrics files hold the figures people compare: the split of a stage record."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tasks.runtime.metrics_files import INGEST_FIGURES, TRAIN_FIGURES, split_figures
from tasks.runtime.params import deep_merge

REPO = Path(__file__).resolve().parents[3]


def test_split_keeps_the_figures_and_moves_everything_else() -> None:
    record = {
        "accuracy": 0.9,
        "epochs": 3,
        "promoted": True,  # DVC would show a bool as a metric; it is a record
        "images_per_sec": None,
        "run_id": "abc",
        "history": [1, 2],
        "final": {"loss": 0.1, "step_time_ms": 3.0, "note": "x"},
        "input_bound": {"ratio": 1.1},
        "promotion": {"reason": "r"},
    }
    figures = ("accuracy", "promoted", "images_per_sec", "final.loss", "input_bound.ratio")
    compared, rest = split_figures(record, figures)
    assert compared == {"accuracy": 0.9, "final": {"loss": 0.1}, "input_bound": {"ratio": 1.1}}
    assert rest == {
        "epochs": 3,
        "promoted": True,
        "images_per_sec": None,
        "run_id": "abc",
        "history": [1, 2],
        "final": {"step_time_ms": 3.0, "note": "x"},
        "promotion": {"reason": "r"},
    }
    assert deep_merge(rest, compared) == record
    assert record["final"] == {"loss": 0.1, "step_time_ms": 3.0, "note": "x"}  # untouched


def count(record: dict[str, object]) -> int:
    return sum(count(v) if isinstance(v, dict) else 1 for v in record.values())


def test_the_metrics_files_hold_about_25_figures() -> None:
    """`dvc exp show` had 204 columns: every per-class and per-format ingest count among
    them. The demo run's records, split as the stages split them, fit a terminal."""
    ingest, _ = split_figures(
        json.loads((REPO / "reports/ingest.json").read_text()), INGEST_FIGURES
    )
    train = json.loads((REPO / "reports/train_summary.json").read_text())
    train = deep_merge(train, json.loads((REPO / "metrics/train.json").read_text()))
    trained, _ = split_figures(train, TRAIN_FIGURES)
    evaluated = json.loads((REPO / "metrics/eval.json").read_text())
    assert count(ingest) == len(INGEST_FIGURES) and count(trained) == len(TRAIN_FIGURES)
    assert count(ingest) + count(trained) + count(evaluated) <= 26
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    metrics = [
        name for stage in stages.values() for entry in stage.get("metrics", []) for name in entry
    ]
    assert sorted(metrics) == ["metrics/eval.json", "metrics/ingest.json", "metrics/train.json"]
