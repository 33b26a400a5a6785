"""What a training run reports: the summary :func:`tasks.train.stage.train` returns and writes
(``metrics/train.json``, ``reports/train_summary.json``, the history rows and plot), and the
run record :func:`tasks.train.stage.run_train` leaves for evaluation (``models/run.json``).

Typed records between functions; a dict only at the JSON edge (:meth:`TrainSummary.to_json`
gives the keys and values the files always held, so they keep their bytes).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.runtime.atomic import write_json
from tasks.runtime.layout import Layout
from tasks.runtime.metrics_files import TRAIN_FIGURES, split_figures
from tasks.runtime.refusals import Refused


@dataclass(frozen=True)
class TrainSummary:
    """One worker's training, as :func:`tasks.train.stage.train` returns it."""

    epochs_completed: int
    history: dict[str, list[float | None]]  # per-epoch values, by figure
    final: dict[str, float]  # the last epoch's figures
    images_per_sec: float | None  # steady-state throughput (after the first epoch)
    model_epoch: int  # the epoch whose weights the model file holds, counted from 1
    model: dict[str, float]  # that epoch's val_loss and val_accuracy
    input_bound: dict[str, float]  # tasks.train.loop.probe_input_bound's figures
    model_file: str
    fingerprint: str  # of the shards trained on
    resumed_from_epoch: int
    precision_policy: str
    xla: bool  # whether the step ran under XLA, as Keras resolved train.xla
    steps_per_execution: int
    strategy: str
    num_workers: int
    num_replicas: int
    chief: bool

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainSummary:
        return cls(**data)


class RunRecordIncomplete(Refused):
    """``models/run.json`` lacks what evaluation needs: the training run or its shards."""


@dataclass(frozen=True)
class TrainRunRecord:
    """The MLflow run a model was trained in and the shards it saw (``models/run.json``).

    :func:`tasks.train.stage.run_train` fills every field; read back, a record needs its
    run and shards (:meth:`load` refuses one without), the rest may be absent (None)."""

    run_id: str
    fingerprint: str
    experiment_id: str | None = None
    tracking_uri: str | None = None
    run_name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: Path) -> TrainRunRecord:
        data = json.loads(path.read_text())
        missing = [key for key in ("run_id", "fingerprint") if not data.get(key)]
        if missing:
            raise RunRecordIncomplete(
                f"{path} names no {' and no '.join(missing)}: it was not written by a "
                "completed training run",
                fix="dvc repro --single-item --force train",
            )
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass(frozen=True)
class TrainedRun:
    """What :func:`tasks.train.stage.run_train` returns: the worker's summary and, on the
    chief, the run record it wrote (None on the other workers, which track nothing)."""

    summary: TrainSummary
    record: TrainRunRecord | None = None

    def to_json(self) -> dict[str, Any]:
        """The summary and the record as one flat dict (the flows' view of a run)."""
        return {**self.summary.to_json(), **(self.record.to_json() if self.record else {})}


def epochs_words(completed: object, resumed_from: object) -> str:
    """``N epochs``, with ``(resumed from epoch K)`` only when the run resumed (K > 0): a
    fresh run starts at epoch 0 and resumed nothing."""
    resumed = f" (resumed from epoch {resumed_from})" if resumed_from else ""
    return f"{completed} epochs{resumed}"


def history_summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Per-epoch lists, final values and throughput from the epoch log: the keyword
    arguments of :class:`TrainSummary` they fill."""
    keys = sorted({key for row in rows for key in row} - {"epoch"})
    history = {key: [row.get(key) for row in rows] for key in keys}
    speeds = [row["images_per_sec"] for row in rows if "images_per_sec" in row]
    # The first epoch pays for tracing; report steady-state throughput when there is one.
    steady = speeds[1:] or speeds
    return {
        "epochs_completed": len(rows),
        "history": history,
        "final": {key: values[-1] for key, values in history.items() if values},
        "images_per_sec": sum(steady) / len(steady) if steady else None,
    }


def write_outputs(summary: TrainSummary, rows: list[dict[str, float]], layout: Layout) -> None:
    """The summary's numbers (DVC's metrics), the rest of it, the plot rows and the plot."""
    numbers, rest = split_figures(
        {k: v for k, v in summary.to_json().items() if k != "history"}, TRAIN_FIGURES
    )
    write_json(layout.train_metrics, numbers)
    write_json(layout.train_summary, rest)
    write_json(layout.train_history, history_rows(rows))
    plot_history(rows, layout.train_plot)


def history_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """The epoch log as DVC plot rows: ``epoch`` counted from 1, as the PNG shows it."""
    return [{**row, "epoch": int(row["epoch"]) + 1} for row in rows]


def plot_history(rows: list[dict[str, float]], path: Path) -> None:
    """Loss and accuracy per epoch, train vs val, as a PNG (no pyplot, no global backend)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    epochs = [int(row["epoch"]) + 1 for row in rows]
    for axis, metric in zip(figure.subplots(1, 2), ("loss", "accuracy"), strict=True):
        for prefix, label in (("", "train"), ("val_", "val")):
            values = [row.get(prefix + metric) for row in rows]
            axis.plot(epochs, values, marker="o", label=label)
        axis.set_xlabel("epoch")
        axis.set_title(metric)
        axis.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
