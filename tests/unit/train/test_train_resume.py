"""A killed run resumes only as the same run: same params, shards and code, same MLflow run."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from tasks.runtime.params import TrainParams, default_params
from tasks.train.backup import BackupDirs
from tasks.train.models import weights_lineage
from tasks.train.stage import (
    IDENTITY_NAME,
    backup_identity,
    claim_backup,
    identity_changes,
    write_identity,
)
from tests.train_helpers import NO_AUGMENT

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
