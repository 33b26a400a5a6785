"""What the training tests share: the repository's train params, a training call on a tiny
project, and a callback that stands in for a kill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras

from tasks.runtime.layout import Layout
from tasks.runtime.params import TrainParams, default_params
from tasks.train.stage import train
from tasks.train.summary import TrainSummary

NO_AUGMENT = {"flip": False, "crop": 0.0, "brightness": 0.0, "contrast": 0.0}


def train_params(**changes: object) -> TrainParams:
    """The repository's train params with ``changes``."""
    return default_params(train=changes).train


def run(root: Path, params: TrainParams, **kwargs: Any) -> TrainSummary:
    return train(params, Layout(root), **kwargs)


class KillAfterEpoch(keras.callbacks.Callback):
    """Stands in for a kill: the process dies right after an epoch's backup is written."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"killed after epoch {epoch + 1}")
