"""The Keras callbacks of a training run: the epoch log that survives a kill, early stopping
whose state is in the backup, each epoch's figures to MLflow and to the stage's report. Part
of the training code version (:func:`tasks.train.stage.training_code_version`): early stopping's
state shapes what a resumed run does."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from tasks.train import backup as train_backup
from tasks.train.backup import BackupDirs, read_epoch_log


class EpochLog(keras.callbacks.Callback):
    """Appends each epoch's logs to a JSON-lines file that survives a killed run.

    On a resumed run the first epoch seen says where training restarted; lines from that
    epoch on (written after the last backup) are dropped before new ones are added.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.first_epoch: int | None = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.first_epoch is None:
            self.first_epoch = epoch
            kept = [row for row in read_epoch_log(self.path) if row["epoch"] < epoch]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json_line(row) for row in kept))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        row = {"epoch": epoch, **{key: float(value) for key, value in (logs or {}).items()}}
        with self.path.open("a") as handle:
            handle.write(json_line(row))


def json_line(row: dict[str, Any]) -> str:
    return json.dumps(row) + "\n"


class ResumableEarlyStopping(keras.callbacks.EarlyStopping):
    """EarlyStopping whose wait count, best value and best weights survive a kill.

    Stock EarlyStopping resets in ``on_train_begin``, so a resumed run would forget how long
    it has waited and which weights were best. The state is saved at each epoch end in the
    phase's backup dir and restored when the phase resumed at the epoch right after it.
    """

    def __init__(self, dirs: BackupDirs, *, resumed_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dirs, self.resumed_at = dirs, resumed_at

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        super().on_train_begin(logs)
        state = train_backup.early_stopping_state(self.dirs, self.resumed_at)
        if state is not None:
            self.wait, self.best = state["wait"], state["best"]
            self.best_epoch, self.stopped_epoch = state["best_epoch"], state["stopped_epoch"]
            self.best_weights = state["best_weights"] or None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        state = {
            "epoch": epoch,
            "wait": self.wait,
            "best": None if self.best is None else float(self.best),
            "best_epoch": self.best_epoch,
            "stopped_epoch": self.stopped_epoch,
        }
        train_backup.save_early_stopping(self.dirs, state, self.best_weights)


class MlflowEpochMetrics(keras.callbacks.Callback):
    """Logs every epoch's metrics to an MLflow run in one batched call per epoch."""

    def __init__(self, mlflow_client: Any, run_id: str) -> None:
        super().__init__()
        self.client = mlflow_client
        self.run_id = run_id

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(mlflow_epoch_name(key), float(value), now, epoch)
            for key, value in (logs or {}).items()
        ]
        self.client.log_batch(self.run_id, metrics=metrics)


# Keras names the training split's figures bare (``loss``, ``accuracy``); in MLflow's runs
# table, beside ``val_*`` and the evaluation's ``test_*``, they say which split they are of.
TRAIN_FIGURES = {"loss": "train_loss", "accuracy": "train_accuracy"}


def mlflow_epoch_name(key: str) -> str:
    """The MLflow metric name of a Keras epoch figure: the training split's prefixed."""
    return TRAIN_FIGURES.get(key, key)


class EpochReport(keras.callbacks.Callback):
    """Hands each finished epoch to ``report(epoch, figures)``, the figures as plain floats
    (picklable: the stage's report may go to a parent process).

    Passed to :func:`run_train` after its own callbacks, so the figures already carry
    throughput and the learning rate.
    """

    def __init__(self, report: Callable[[int, dict[str, float]], object]) -> None:
        super().__init__()
        self.report = report

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.report(epoch, {key: float(value) for key, value in (logs or {}).items()})
