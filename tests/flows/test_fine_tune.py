"""Fine-tuning end to end: frozen backbone, then the top layers at a lower rate, across kills.

MobileNetV3Small with random weights on 32x32 shards; the train stage is killed in the
frozen phase, between the phases and in the fine-tune phase, and each rerun resumes where
the last one stopped, in the same MLflow run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from mlflow import MlflowClient

from tasks.runtime.layout import Layout
from tasks.runtime.params import default_params
from tasks.train.models import backbone_of
from tasks.train.stage import FINE_TUNE_LR_FACTOR, IDENTITY_NAME, read_epoch_log, run_train
from tests.tiny_shards import write_tiny_shards

pytestmark = pytest.mark.slow
TOP = 5
PARAMS = default_params(
    train={
        "model": "mobilenet_v3_small",
        "weights": None,
        "epochs": 2,
        "fine_tune_layers": TOP,
        "fine_tune_epochs": 2,
        "batch_size": 8,
        "learning_rate": 0.01,
        "lr_schedule": "constant",
        "early_stopping_patience": 0,
        "augment": {"flip": False, "crop": 0.0, "brightness": 0.0, "contrast": 0.0},
    }
)


class Kill(keras.callbacks.Callback):
    """Dies at the start or the end of an epoch, keeping the weights it died with."""

    def __init__(self, epoch: int, *, at: str) -> None:
        super().__init__()
        self.epoch, self.at = epoch, at
        self.weights: list[np.ndarray] | None = None

    def _maybe_die(self, epoch: int, when: str) -> None:
        if epoch == self.epoch and when == self.at:
            self.weights = [w.copy() for w in self.model.get_weights()]
            raise KeyboardInterrupt(f"killed at the {when} of epoch {epoch + 1}")

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._maybe_die(epoch, "begin")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._maybe_die(epoch, "end")


class Capture(keras.callbacks.Callback):
    """The weights and trainable variables the model has when ``epoch`` begins."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch
        self.weights: list[np.ndarray] | None = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == self.epoch:
            self.weights = [w.copy() for w in self.model.get_weights()]


def killed(layout: Layout, *callbacks: keras.callbacks.Callback) -> None:
    with pytest.raises(KeyboardInterrupt):
        run_train(PARAMS, layout, callbacks=list(callbacks))


def test_fine_tuning_resumes_in_either_phase_and_unfreezes_the_top(
    tmp_path: Path, mlflow_uri: str
) -> None:
    write_tiny_shards(tmp_path, size=32, per_class={"train": 8, "val": 2, "test": 2})
    layout = Layout(tmp_path)
    epochs_logged = lambda: [  # noqa: E731
        int(row["epoch"]) for row in read_epoch_log(layout.backup_dir / "epochs.jsonl")
    ]

    # 1. Killed in the frozen phase, after its first epoch.
    killed(layout, Kill(0, at="end"))
    run_id = json.loads((layout.backup_dir / IDENTITY_NAME).read_text())["mlflow_run_id"]
    assert epochs_logged() == [0]

    # 2. Resumes the frozen phase at epoch 2, finishes it, killed before fine-tuning starts.
    between = Kill(PARAMS.train.epochs, at="begin")
    killed(layout, between)
    assert epochs_logged() == [0, 1]
    assert (layout.backup_dir / "main_phase.weights.h5").exists()
    frozen_rows = read_epoch_log(layout.backup_dir / "epochs.jsonl")

    # 3. Starts fine-tuning from the frozen phase's weights; killed after its first epoch.
    start = Capture(PARAMS.train.epochs)
    killed(layout, start, Kill(PARAMS.train.epochs, at="end"))
    assert start.weights is not None and between.weights is not None
    for got, want in zip(start.weights, between.weights, strict=True):
        np.testing.assert_array_equal(got, want)  # not from scratch
    assert epochs_logged() == [0, 1, 2]

    # 4. Resumes inside the fine-tune phase and completes.
    summary = run_train(PARAMS, layout).to_json()
    total = PARAMS.train.epochs + PARAMS.train.fine_tune_epochs
    assert summary["resumed_from_epoch"] == PARAMS.train.epochs + 1
    assert summary["epochs_completed"] == total
    rows = json.loads(layout.train_history.read_text())
    losses = [row["loss"] for row in rows]
    assert losses[:2] == [row["loss"] for row in frozen_rows]  # frozen phase kept
    rates = [row["learning_rate"] for row in rows]
    assert rates[:2] == [pytest.approx(PARAMS.train.learning_rate)] * 2
    assert rates[2:] == [pytest.approx(PARAMS.train.learning_rate * FINE_TUNE_LR_FACTOR)] * 2
    assert summary["run_id"] == run_id  # one MLflow run across three kills
    client = MlflowClient(mlflow_uri)
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert sorted(steps) == list(range(total))
    assert not layout.backup_dir.exists()

    model = keras.saving.load_model(layout.model_file)
    backbone = backbone_of(model)
    assert backbone is not None and backbone.trainable
    top = [layer for layer in backbone.layers[-TOP:] if layer.weights]
    assert top and all(
        layer.trainable for layer in top if not isinstance(layer, keras.layers.BatchNormalization)
    )
    assert not any(layer.trainable for layer in backbone.layers[:-TOP] if layer.weights)
