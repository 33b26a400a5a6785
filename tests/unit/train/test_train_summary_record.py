"""The training summary and run record are typed, and serialize to the bytes the committed
files hold: the type changes no file a stage wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tasks.runtime.atomic import write_json
from tasks.runtime.layout import Layout
from tasks.runtime.params import deep_merge
from tasks.train.summary import (
    RunRecordIncomplete,
    TrainedRun,
    TrainRunRecord,
    TrainSummary,
    history_summary,
    write_outputs,
)

REPO = Layout(Path(__file__).resolve().parents[3])


def committed_rows() -> list[dict[str, float]]:
    """The committed run's epoch log, as the backup holds it (``epoch`` from 0)."""
    plot_rows = json.loads(REPO.train_history.read_text())
    return [{**row, "epoch": row["epoch"] - 1} for row in plot_rows]


def committed_summary() -> TrainSummary:
    """The committed run's summary, built through the type: the epoch figures from the
    epoch log, the rest from the two files the stage wrote."""
    written: dict[str, Any] = deep_merge(
        json.loads(REPO.train_summary.read_text()), json.loads(REPO.train_metrics.read_text())
    )
    by_epoch = history_summary(committed_rows())
    assert by_epoch["final"] == written["final"]  # the log is the committed run's
    return TrainSummary.from_json({**written, **by_epoch})


def test_a_typed_summary_writes_the_committed_bytes(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    write_outputs(committed_summary(), committed_rows(), layout)
    for path in ("train_metrics", "train_summary", "train_history"):
        assert getattr(layout, path).read_bytes() == getattr(REPO, path).read_bytes(), path


def test_the_summary_is_typed_through_and_through() -> None:
    summary = committed_summary()
    assert summary.xla is False and summary.chief is True
    # the epoch whose weights were kept (counted from 1) is one the history holds
    assert 1 <= summary.model_epoch <= len(summary.history["val_loss"]) == summary.epochs_completed
    assert TrainSummary.from_json(summary.to_json()) == summary


def test_the_run_record_writes_the_committed_bytes(tmp_path: Path) -> None:
    record = TrainRunRecord.load(REPO.train_run)
    # the committed run trained on the shard set the committed validation report vouches for
    validated = json.loads(REPO.validation_report.read_text())["fingerprint"]
    assert len(record.run_id) == 32 and record.fingerprint == validated
    write_json(tmp_path / "run.json", record.to_json())
    assert (tmp_path / "run.json").read_bytes() == REPO.train_run.read_bytes()


def test_a_runs_flat_view_holds_the_summary_and_the_chiefs_record() -> None:
    summary = committed_summary()
    record = TrainRunRecord.load(REPO.train_run)
    flat = TrainedRun(summary, record).to_json()
    assert flat["run_id"] == record.run_id and flat["epochs_completed"] == 20
    assert "run_id" not in TrainedRun(summary).to_json()  # another worker tracks nothing


def test_a_run_record_without_its_run_or_shards_is_refused_naming_them(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    write_json(path, {"run_id": "a" * 32})
    with pytest.raises(RunRecordIncomplete, match=r"run\.json names no fingerprint") as refused:
        TrainRunRecord.load(path)
    assert refused.value.fix == "dvc repro --single-item --force train"
    write_json(path, {"run_id": "a" * 32, "fingerprint": "f" * 64, "note": "by hand"})
    assert TrainRunRecord.load(path) == TrainRunRecord("a" * 32, "f" * 64)  # the rest: None


@pytest.mark.parametrize(
    ("resumed_from", "words"),
    [(0, "20 epochs"), (None, "20 epochs"), (5, "20 epochs (resumed from epoch 5)")],
    ids=["fresh", "unrecorded", "resumed"],
)
def test_a_run_says_it_resumed_only_when_it_did(resumed_from: int | None, words: str) -> None:
    from tasks.train.summary import epochs_words

    assert epochs_words(20, resumed_from) == words
