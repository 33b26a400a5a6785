"""A killed run resumes only as the same run (same params, shards and code, same MLflow run);
resuming training on tiny shards: reruns with other or the same params, changed shards, a
damaged backup, early stopping and a SIGKILL."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
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
from tasks.train.backup import BackupDirs
from tasks.train.callbacks import ResumableEarlyStopping
from tasks.train.models import weights_lineage
from tasks.train.stage import (
    IDENTITY_NAME,
    backup_identity,
    claim_backup,
    identity_changes,
    read_epoch_log,
    run_train,
    write_identity,
)
from tests.train_helpers import NO_AUGMENT, KillAfterEpoch, run

pytestmark = pytest.mark.slow

LR_A, LR_B = 0.003, 0.001
NO_WEIGHTS = weights_lineage(None)  # small_cnn starts from no weights file


class Lines(logging.Handler):
    """Collects formatted records; attached straight to the logger, so Prefect's logging
    setup (which replaces the root handlers pytest's caplog relies on) cannot drop it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def warnings_logged() -> Iterator[Lines]:
    logger, handler = logging.getLogger("tasks.train.stage"), Lines()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def params(lr: float = LR_A, **overrides: Any) -> TrainParams:
    settings: dict[str, Any] = {
        "epochs": 3,
        "batch_size": 16,
        "learning_rate": lr,
        "early_stopping_patience": 0,
        "augment": NO_AUGMENT,
    }
    return default_params(train={**settings, **overrides}).train


# -- which backup may be resumed (no training) ---------------------------------------------


def test_identity_changes_name_each_difference() -> None:
    stored = backup_identity(params(LR_A), "a" * 64, NO_WEIGHTS)
    current = {
        **backup_identity(params(LR_B), "b" * 64, NO_WEIGHTS),
        "code_version": "0123456789ab",
    }
    reasons = identity_changes(stored, current)
    assert reasons[0] == f"train.learning_rate changed {LR_A} -> {LR_B}"
    assert reasons[1] == f"shards changed: fingerprint {'a' * 12} -> {'b' * 12}"
    assert reasons[2].startswith(f"training code changed: version {stored['code_version']} ->")
    assert len(reasons) == 3
    assert identity_changes(stored, backup_identity(params(LR_A), "a" * 64, NO_WEIGHTS)) == []


def test_a_weights_file_overwritten_with_other_weights_is_a_change_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same ``train.weights`` path holding other weights resumed the backup made from
    the first ones (the identity held the path alone), and the MLflow run logged the same
    params; only a file under models/pretrained/, a train stage dependency, retrains."""
    from tasks.train.models import PRETRAINED_DIR, untracked_weights

    monkeypatch.chdir(tmp_path)
    weights = Path(PRETRAINED_DIR) / "backbone.weights.h5"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"first weights")
    transfer = default_params(train={"model": "mobilenet_v3_small", "weights": str(weights)})

    def identity() -> dict[str, Any]:
        return backup_identity(transfer.train, "a" * 64, weights_lineage(str(weights)))

    stored = identity()
    assert identity_changes(stored, identity()) == []
    weights.write_bytes(b"other weights")
    current = identity()
    [reason] = identity_changes(stored, current)
    assert reason.startswith("train.weights_sha256 changed")
    assert weights_lineage(str(weights)) == {
        "train.weights_sha256": current["params"]["train.weights_sha256"]
    }
    assert weights_lineage(None) == weights_lineage("imagenet") == {"train.weights_sha256": "none"}
    assert untracked_weights(str(weights)) is None
    assert untracked_weights("imagenet") is None
    (tmp_path / "elsewhere.weights.h5").write_bytes(b"w")
    assert "outside models/pretrained/" in str(untracked_weights("elsewhere.weights.h5"))


def test_backup_without_identity_is_discarded_with_the_reason(
    tmp_path: Path, warnings_logged: Lines
) -> None:
    backup = tmp_path / "train_backup"
    (backup / "main").mkdir(parents=True)
    (backup / "main" / "training_metadata.json").write_text('{"epoch": 1, "batch": 0}')
    identity = backup_identity(params(), "f" * 64, NO_WEIGHTS)
    stored, reasons = claim_backup(backup, identity)
    assert stored is None and "identity.json is missing" in reasons[0]
    assert not backup.exists()
    assert (
        "backup discarded: " in warnings_logged.text
        and "identity.json is missing" in warnings_logged.text
    )


def test_matching_backup_is_kept_with_its_run_id(tmp_path: Path) -> None:
    backup = tmp_path / "train_backup"
    identity = backup_identity(params(), "f" * 64, NO_WEIGHTS)
    write_identity(backup, identity, "run-123")
    stored, reasons = claim_backup(backup, identity)
    assert reasons == [] and stored is not None and stored["mlflow_run_id"] == "run-123"
    assert (backup / IDENTITY_NAME).exists()


def test_a_workers_scratch_backup_stays_in_the_repository_and_a_killed_ones_is_emptied(
    tmp_path: Path,
) -> None:
    backup = tmp_path / ".shardflow" / "train_backup"
    chief = BackupDirs.for_worker(backup, chief=True, worker="worker-0")
    assert chief.read == chief.write == backup
    first = BackupDirs.for_worker(backup, chief=False, worker="worker-1")
    assert first.read == backup and first.write.is_relative_to(tmp_path / ".shardflow")
    (first.write / "main").mkdir(parents=True)
    (first.write / "main" / "weights.h5").write_bytes(b"left by a killed worker")
    again = BackupDirs.for_worker(backup, chief=False, worker="worker-1")
    assert again.write == first.write and not again.write.exists()
    assert BackupDirs.for_worker(backup, chief=False, worker="worker-2").write != first.write


# -- the stage: MLflow run follows the backup ---------------------------------------------


def test_a_kill_before_the_epochs_commit_resumes_that_epoch_from_the_last_committed_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after epoch 1's weights were written but before ``epoch.json`` named them:
    the rerun starts at epoch 1 with epoch 0's weights and random state, never with the
    weights of the epoch it is about to train again."""
    import tasks.train.backup as backup

    def model() -> keras.Model:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(2)(keras.layers.Dropout(0.5, seed=1)(inputs))
        return keras.Model(inputs, outputs)

    dirs = BackupDirs(tmp_path, tmp_path)
    trained = model()
    for v in backup.random_state(trained):  # not a fresh model's state
        v.assign(v.numpy() + 3)
    backup.save_epoch(trained, dirs, 0)
    committed = [w.copy() for w in trained.get_weights()]
    committed_random = [v.numpy().copy() for v in backup.random_state(trained)]
    trained.set_weights([w + 1.0 for w in committed])
    for v in backup.random_state(trained):
        v.assign(v.numpy() + 7)
    real_write_json = backup.write_json

    def killed_at_commit(path: Path, value: Any) -> None:
        if path.name == backup.EPOCH_NAME:
            raise KeyboardInterrupt
        real_write_json(path, value)

    monkeypatch.setattr(backup, "write_json", killed_at_commit)
    with pytest.raises(KeyboardInterrupt):
        backup.save_epoch(trained, dirs, 1)
    monkeypatch.undo()

    resumed = model()
    resumed.set_weights([np.zeros_like(w) for w in committed])
    assert backup.restore_epoch(resumed, dirs) == 1
    for got, want in zip(resumed.get_weights(), committed, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(backup.random_state(resumed), committed_random, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
    backup.save_epoch(resumed, dirs, 1)  # the rerun commits epoch 1: one epoch's files left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != backup.EPOCH_NAME) == [
        "random-1.npz",
        "state-1.weights.h5",
    ]


# -- early stopping across a kill ------------------------------------------------------------


# -- a real kill -------------------------------------------------------------------------------

SIGKILL_SCRIPT = """
import os, signal, sys
import keras
from tasks.runtime.layout import Layout
from tasks.runtime.params import TrainParams
from tasks.train.stage import train

class Die(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no finally, no cleanup

layout = Layout(sys.argv[1])
train(TrainParams.model_validate_json(sys.argv[2]), layout, callbacks=[Die()])
"""


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
