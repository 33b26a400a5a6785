"""Resuming training on tiny shards: reruns with other or the same params, changed shards, a
damaged backup, early stopping and a SIGKILL (the backup's identity:
tests/unit/train/test_train_resume.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from mlflow import MlflowClient

import tasks.train.loop as train_loop
import tasks.train.stage as train_module
from tasks.runtime.layout import Layout
from tasks.runtime.params import Params, TrainParams, default_params
from tasks.train.callbacks import ResumableEarlyStopping
from tasks.train.stage import (
    IDENTITY_NAME,
    read_epoch_log,
    run_train,
)
from tests.train_helpers import KillAfterEpoch, run
from tests.unit.train import test_train_resume as unit
from tests.unit.train.test_train_resume import LR_A, LR_B, SIGKILL_SCRIPT, Lines, params

pytestmark = pytest.mark.slow
warnings_logged = unit.warnings_logged  # the unit tests' fixture, shared


def with_train(train: TrainParams) -> Params:
    return default_params().model_copy(update={"train": train})


class Stop(Exception):
    """Raised where training would begin: what came before it is what a test looks at."""


def test_a_run_hashes_its_weights_file_once(
    tiny_shards: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_train hashed the ``train.weights`` file for the backup identity and for the run's
    inputs, and train a third time: one sha256 now serves the identity, the MLflow run and
    the training core, and they name the same one."""
    import tasks.train.models as models_module

    monkeypatch.chdir(tiny_shards)
    weights = Path(models_module.PRETRAINED_DIR) / "backbone.weights.h5"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    hashed: list[str] = []
    real_sha256 = models_module.file_sha256

    def counted(path: str | Path) -> str:
        hashed.append(str(path))
        return real_sha256(path)

    def stop(*args: object, **kwargs: object) -> None:
        raise Stop

    monkeypatch.setattr(models_module, "file_sha256", counted)
    monkeypatch.setattr(train_module, "fit_phases", stop)
    params = default_params(train={"model": "mobilenet_v3_small", "weights": str(weights)})
    layout = Layout(tiny_shards)
    with pytest.raises(Stop):
        run_train(params, layout)
    assert hashed == [str(weights)]
    sha256 = real_sha256(weights)
    stored = json.loads((layout.backup_dir / IDENTITY_NAME).read_text())
    assert stored["params"]["train.weights_sha256"] == sha256
    client = MlflowClient(mlflow_uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["train.weights_sha256"] == sha256


def kill_run(layout: Layout, lr: float) -> str:
    """Start run_train with ``lr`` and kill it after epoch 1; return the killed MLflow run."""
    with pytest.raises(KeyboardInterrupt):
        run_train(with_train(params(lr)), layout, callbacks=[KillAfterEpoch(0)])
    identity = json.loads((layout.backup_dir / IDENTITY_NAME).read_text())
    assert identity["params"]["train.learning_rate"] == lr
    return str(identity["mlflow_run_id"])


def test_rerun_with_another_learning_rate_starts_over_in_a_new_run(
    tiny_shards: Path, mlflow_uri: str, warnings_logged: Lines
) -> None:
    layout = Layout(tiny_shards)
    killed = kill_run(layout, LR_A)
    summary = run_train(with_train(params(LR_B)), layout).to_json()
    assert f"backup discarded: train.learning_rate changed {LR_A} -> {LR_B}" in warnings_logged.text
    assert summary["resumed_from_epoch"] == 0
    assert summary["epochs_completed"] == 3
    assert summary["run_id"] != killed
    client = MlflowClient(mlflow_uri)
    assert client.get_run(killed).info.status == "FAILED"
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.learning_rate"] == str(LR_B)
    assert "train.learning_rate changed" in run.data.tags["resume.backup_discarded"]
    steps = [m.step for m in client.get_metric_history(summary["run_id"], "train_loss")]
    assert sorted(steps) == [0, 1, 2]


def test_rerun_with_the_same_params_resumes_in_the_same_run(
    tiny_shards: Path, mlflow_uri: str
) -> None:
    layout = Layout(tiny_shards)
    killed = kill_run(layout, LR_A)
    summary = run_train(with_train(params(LR_A)), layout).to_json()
    assert summary["resumed_from_epoch"] == 1  # the second epoch, not from scratch
    assert summary["epochs_completed"] == 3
    assert summary["run_id"] == killed
    client = MlflowClient(mlflow_uri)
    assert client.get_run(killed).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(killed, "train_loss")]
    assert sorted(steps) == [0, 1, 2]  # one point per epoch across the kill
    assert not layout.backup_dir.exists()


def test_changed_shards_discard_the_backup(tiny_shards: Path) -> None:
    from tests.tiny_shards import write_tiny_shards

    with pytest.raises(KeyboardInterrupt):
        run(tiny_shards, params(), callbacks=[KillAfterEpoch(0)])
    write_tiny_shards(tiny_shards, seed=1)  # other pixels: another fingerprint
    summary = run(tiny_shards, params())
    assert summary.resumed_from_epoch == 0


def test_backup_that_cannot_be_restored_never_fails_the_rerun(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch, warnings_logged: Lines
) -> None:
    """An architecture change the identity cannot see (same params, same hashed code)."""
    layout = Layout(tiny_shards)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_shards, params(), callbacks=[KillAfterEpoch(0)])
    original = train_module.build_model

    def wider(*args: Any) -> keras.Model:
        model = original(*args)
        x = keras.layers.Dense(7, name="extra")(model.layers[-2].output)
        outputs = keras.layers.Dense(3, activation="softmax", name="probs2")(x)
        return keras.Model(model.inputs, outputs)

    monkeypatch.setattr(train_module, "build_model", wider)
    summary = run(tiny_shards, params())
    assert "backup discarded: cannot restore" in warnings_logged.text
    assert summary.resumed_from_epoch == 0
    assert summary.epochs_completed == 3
    assert len(json.loads(layout.train_history.read_text())) == 3
    assert not layout.backup_dir.exists()


class RecordWeights(keras.callbacks.Callback):
    """The model's weights at the end of each epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.by_epoch: dict[int, list[np.ndarray]] = {}

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.by_epoch[epoch] = [w.copy() for w in self.model.get_weights()]


def test_early_stopping_wait_best_and_best_weights_survive_a_kill(
    tiny_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(tiny_shards)
    es_params = params(epochs=4, early_stopping_patience=10)  # never stops: state only
    recorder = RecordWeights()
    with pytest.raises(KeyboardInterrupt):
        run(tiny_shards, es_params, callbacks=[recorder, KillAfterEpoch(2)])
    rows = read_epoch_log(layout.backup_dir / "epochs.jsonl")
    losses = [row["val_loss"] for row in rows]
    best_epoch = int(np.argmin(losses))
    expected_wait = len(losses) - 1 - best_epoch

    restored: list[ResumableEarlyStopping] = []

    class Recording(ResumableEarlyStopping):
        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            super().on_train_begin(logs)
            restored.append(self)
            self.snapshot = (self.wait, self.best, self.best_epoch, self.best_weights)

    monkeypatch.setattr(train_loop, "ResumableEarlyStopping", Recording)
    summary = run(tiny_shards, es_params)
    assert summary.resumed_from_epoch == 3
    wait, best, restored_best_epoch, best_weights = restored[0].snapshot
    assert best == pytest.approx(losses[best_epoch])
    assert restored_best_epoch == best_epoch
    assert wait == expected_wait
    assert best_weights is not None
    for got, want in zip(best_weights, recorder.by_epoch[best_epoch], strict=True):
        np.testing.assert_array_equal(got, want)


def test_sigkilled_process_resumes_only_with_the_same_params(tiny_shards: Path) -> None:
    layout = Layout(tiny_shards)
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    killed = subprocess.run(
        [sys.executable, "-c", SIGKILL_SCRIPT, str(tiny_shards), params().model_dump_json()],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [row["epoch"] for row in read_epoch_log(layout.backup_dir / "epochs.jsonl")] == [0]
    summary = run(tiny_shards, params())
    assert summary.resumed_from_epoch == 1
    assert summary.epochs_completed == 3
